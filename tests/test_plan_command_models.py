"""``tfpar plan --model``: GPT, Llama and BERT shapes planned on a described
cluster without a script; the options change the graph built as they say;
bad arguments are refused naming the one at fault."""
import json
import sys

import pytest
import tensorflow as tf

from tfpar import cli
from tfpar.cluster.hardware import CATALOG
from tfpar.models import MODELS, builder
from tfpar.models.bert import default_predictions
from tfpar.models.llama import default_ffn
import warm_python

v1 = tf.compat.v1
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "16", "--vocab", "96",
         "--batch", "32"]


def plan_json(capsys, *argv):
    """The plan ``tfpar plan --json`` prints for ``argv``."""
    assert cli.main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model,extra", [("gpt", []), ("llama", ["--kv-heads", "2"]),
                                         ("bert", ["--tied-embeddings"])])
def test_each_model_is_planned_on_the_described_cluster(capsys, model, extra):
    plan = plan_json(capsys, "--model", model, *SMALL, *extra, "--cluster", "16 x A100-80GB")
    devices = {d for tg in plan["task_graphs"] for d in tg["devices"]}
    assert len(devices) == 16
    assert plan["estimate"]["step_time_s"] > 0
    assumed = plan["estimate"]["assumptions"]
    assert (assumed["device"], assumed["devices"], assumed["devices_per_node"]) == (
        "A100-80GB", 16, 8)
    assert (assumed["global_batch"], assumed["batch_from"]) == (32, "the model's inputs")


def test_the_summary_is_what_plan_of_a_script_prints(capsys, caplog):
    """The same summary, the described cluster in its assumptions; the
    build's progress and the search's as progress lines."""
    assert cli.main(["plan", "--model", "gpt", *SMALL, "--cluster", "16 x V100-32GB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tfpar plan: data_parallel_degree=")
    assert "assumes: 16 x V100-32GB, 8 a node" in out and "estimate: step_time=" in out
    assert out.splitlines()[-1] == ("devices: logical CPU devices of one host, standing in for "
                                    "the V100-32GB devices described, e.g. CPU:1-15")
    progress = [r.getMessage() for r in caplog.records if r.name == "tfpar.progress"]
    assert progress[0] == ("tfpar plan: building gpt (layers 2, hidden 64, heads 4, seq 16, "
                           "vocab 96, batch 32) ...")
    assert progress[1].startswith("tfpar plan: built ")
    assert progress[1].endswith("planning for 16 x V100-32GB ...")
    assert any(line.startswith("tfpar auto [1/") for line in progress[2:])


def test_out_writes_the_plan_and_says_where(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "llama", *SMALL, "--cluster", "4 x H100-80GB",
                     "--out", str(path)]) == 0
    assert capsys.readouterr().out == f"tfpar plan: wrote the plan's JSON to {path}\n"
    assert json.loads(path.read_text())["estimate"]["step_time_s"] > 0


def test_options_reach_the_planned_graph(capsys):
    """Tied embeddings drop the output projection's vocab x hidden weights
    from the plan's parameters (float32: 4 bytes each)."""
    def params(*extra):
        plan = plan_json(capsys, "--model", "gpt", *SMALL, "--cluster", "2 x T4", *extra)
        return sum(tg["param_bytes"] for tg in plan["task_graphs"])
    assert params() - params("--tied-embeddings") == 96 * 64 * 4


def test_mask_reaches_the_gpt_and_only_the_gpt(capsys):
    """--mask shared builds one causal mask for the 2 layers, per_layer one
    in each (more ops); other models refuse it."""
    def masks(*extra):
        plan = plan_json(capsys, "--model", "gpt", *SMALL, "--cluster", "2 x T4", *extra)
        return sum(tg["num_ops"] for tg in plan["task_graphs"])
    none, shared, per_layer = masks(), masks("--mask", "shared"), masks("--mask", "per_layer")
    assert none < shared < per_layer
    assert cli.main(["plan", "--model", "llama", *SMALL, "--cluster", "2 x T4",
                     "--mask", "shared"]) == 2
    assert "--mask: only --model gpt" in capsys.readouterr().err


def test_the_plan_says_the_virtual_stages_it_chose(capsys):
    """Eight blocks on two T4s in a pipeline of 2 micro-batches (1F1B): a
    third of the step is bubble, which two stages a device halve (estimated
    21.3 ms plain, 18.0 ms interleaved), and the summary says so."""
    assert cli.main(["plan", "--model", "gpt", "--layers", "8", *SMALL[2:], "--mask",
                     "per_layer", "--cluster", "2 x T4", "--config",
                     '{"auto.num_task_graph": 2, "pipeline.num_micro_batch": 2, '
                     '"pipeline.schedule": "1f1b"}']) == 0
    out = capsys.readouterr().out
    assert out.startswith("tfpar plan: data_parallel_degree=1 num_micro_batch=2 schedule=1f1b "
                          "virtual_stages=2 (interleaved)")
    assert [line.split()[6] for line in out.splitlines() if line.startswith("stage_")] == [
        "CPU:0", "CPU:1", "CPU:0", "CPU:1"]


@pytest.mark.parametrize("stages,memory_gb", [(2, 0.022), (1, 0.03)])
def test_task_graph_estimates_add_up_to_the_plans(capsys, stages, memory_gb):
    """Issue 64: the TaskGraphs of a plan that shards layers were costed
    layer by layer in float32 at one micro-batch, without the plan's
    recomputation, ZeRO or mixed precision, and their time summed over the
    micro-batches (GPT-3 on 1024 A100s: 83-93 GiB per device on 80 GB cards
    and 29.9 s a stage, beside an estimate of 74.0 GiB and 19.2 s). Now
    they are the plan's estimate shared out: on every device the
    TaskGraphs' bytes add up to the estimate's for it, within the card, and
    their busy time to no more than the step - tensor 2 x pipeline 2 with
    full recomputation and 4 micro-batches, and tensor only."""
    tiny = {"name": "tiny", "tflops": 10, "memory_gb": memory_gb, "intra_node_gbps": 100}
    plan = plan_json(capsys, "--model", "gpt", "--layers", "4", "--hidden", "256", "--heads", "4",
                     "--seq", "64", "--vocab", "512", "--batch", "32", "--cluster", "8 x T4",
                     "--config", json.dumps({"cluster.hardware": [tiny] * 8,
                                             "auto.num_task_graph": stages,
                                             "auto.memory_techniques": ["recompute"]}))
    est = plan["estimate"]
    assert plan["sharding"]["tensor_degree"] > 1 and est["recompute"] == "full"
    assert plan["pipeline"]["num_micro_batch"] > 1
    devices = sorted({d for tg in plan["task_graphs"] for d in tg["devices"]})
    for device, memory in zip(devices, est["memory_bytes_per_device"]):
        on = [tg["estimate"] for tg in plan["task_graphs"] if device in tg["devices"]]
        assert sum(e["memory_bytes"] for e in on) == pytest.approx(memory)
        assert sum(e["time_s"] for e in on) <= est["step_time_s"] * (1 + 1e-6)
    assert max(est["memory_bytes_per_device"]) <= memory_gb * 2 ** 30
    assert sum(tg["estimate"]["comm_bytes"] for tg in plan["task_graphs"]) <= est["comm_bytes"]


def test_config_keys_go_over_the_commands_defaults(capsys):
    plan = plan_json(capsys, "--model", "gpt", *SMALL, "--cluster", "8 x A100-80GB",
                     "--config", '{"auto.memory_techniques": [], "auto.num_task_graph": 2}')
    assert plan["pipeline"]["num_stages"] == 2
    assert not plan["estimate"]["memory_techniques"], plan["estimate"]


# --- the graphs built ------------------------------------------------------------

def kernels(model, **shape):
    """{variable name: shape} of the trainable variables ``model`` builds."""
    with tf.Graph().as_default():
        builder(model)(**shape)
        return {v.op.name: v.shape.as_list() for v in v1.trainable_variables()}


GPT = dict(layers=1, hidden=64, seq=16, vocab=96, heads=4, batch=8)
LLAMA = dict(layers=1, hidden=64, ffn=160, heads=4, kv_heads=4, seq=16, vocab=96, batch=8)


@pytest.mark.parametrize("model,shape", [("gpt", GPT), ("bert", GPT)])
def test_fused_qkv_makes_one_projection(model, shape):
    plain, fused = kernels(model, **shape), kernels(model, **shape, fused_qkv=True)
    attention = "layer_0/attention/"
    assert {f"{attention}{n}/kernel" for n in "qkv"} <= set(plain)
    assert not any(f"{attention}{n}/" in name for n in "qkv" for name in fused)
    assert fused[f"{attention}qkv/kernel"] == [64, 3 * 64]


def test_grouped_query_attention_shrinks_k_and_v():
    """4 query heads of width 16 sharing 1 key/value head: k and v project to
    16, q to 64; fused, one projection of 64 + 2 x 16."""
    mha, gqa = kernels("llama", **LLAMA), kernels("llama", **{**LLAMA, "kv_heads": 1})
    for name, width in (("q", 64), ("k", 16), ("v", 16)):
        assert gqa[f"layer_0/attention/{name}/kernel"] == [64, width]
        assert mha[f"layer_0/attention/{name}/kernel"] == [64, 64]
    fused = kernels("llama", **{**LLAMA, "kv_heads": 1}, fused_qkv=True)
    assert fused["layer_0/attention/qkv/kernel"] == [64, 64 + 2 * 16]


@pytest.mark.parametrize("model,shape,head", [("gpt", GPT, "lm_head/kernel"),
                                              ("llama", LLAMA, "output/kernel"),
                                              ("bert", GPT, "masked_lm/decoder/kernel")])
def test_tied_embeddings_make_one_vocabulary_variable(model, shape, head):
    def vocabulary(variables):
        return [n for n, s in variables.items() if 96 in s and len(s) == 2]
    assert vocabulary(kernels(model, **shape)) == ["embedding/tokens", head]
    assert vocabulary(kernels(model, **shape, tied_embeddings=True)) == ["embedding/tokens"]


def test_mlp_width_and_its_defaults():
    assert kernels("gpt", **GPT)["layer_0/fc1/kernel"] == [64, 256]
    assert kernels("gpt", **GPT, ffn=100)["layer_0/fc1/kernel"] == [64, 100]
    assert kernels("llama", **LLAMA)["layer_0/mlp/gate/kernel"] == [64, 160]
    assert default_ffn(4096) == 11008  # Llama 2 7B's


def test_bert_predicts_its_masked_positions_only():
    with tf.Graph().as_default() as graph:
        builder("bert")(**GPT)
        masked = graph.get_tensor_by_name("masked_positions:0")
    assert masked.shape.as_list() == [8, default_predictions(16)] == [8, 2]


def test_the_model_names_are_the_builders():
    assert sorted(MODELS) == ["bert", "gpt", "llama"]
    assert all(callable(builder(name)) for name in MODELS)


# --- refused arguments -----------------------------------------------------------

@pytest.mark.parametrize("argv,culprit", [
    (["--cluster", "16 x A100"], "unknown device 'A100'"),
    (["--cluster", "0 x A100-80GB"], "no device described"),
    (["--cluster", "16 x P100-16GB"], "give --devices-per-node"),
    (["--cluster", "2 x T4", "--kv-heads", "2"], "only --model llama"),
    (["--cluster", "2 x T4", "--heads", "5"], "--hidden 64 is not a multiple of --heads 5"),
    (["--cluster", "2 x T4", "--config", '{"auto.bogus": 1}'], "auto.bogus"),
], ids=["device", "count", "node", "kv-heads", "heads", "config"])
def test_bad_arguments_name_the_culprit(capsys, argv, culprit):
    assert cli.main(["plan", "--model", "gpt", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfpar plan: ") and culprit in err, err
    if culprit.startswith("unknown device"):
        assert all(name in err for name in CATALOG)


def test_llama_arguments_are_checked(capsys):
    args = ["plan", "--model", "llama", *SMALL, "--cluster", "2 x T4"]
    assert cli.main([*args, "--kv-heads", "3"]) == 2
    assert "--kv-heads 3 does not divide --heads 4" in capsys.readouterr().err
    assert cli.main([*args, "--hidden", "60"]) == 2  # heads of 15
    assert "must be even (rotary embeddings)" in capsys.readouterr().err


def test_missing_shape_and_script_or_model(capsys):
    assert cli.main(["plan", "--model", "bert", "--layers", "2", "--cluster", "2 x T4"]) == 2
    assert "--model bert needs --hidden, --heads, --seq, --vocab, --batch" in capsys.readouterr().err
    assert cli.main(["plan"]) == 2
    assert "give a SCRIPT or --model, not neither" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "gpt", *SMALL, "--cluster", "2 x T4", "train.py"]) == 2
    assert "not both" in capsys.readouterr().err


def test_argparse_refuses_unknown_models_and_non_positive_sizes():
    for argv, message in ((["--model", "t5"], "invalid choice: 't5'"),
                          (["--model", "gpt", "--layers", "0"], "--layers: 0 is not >= 1")):
        done = warm_python.run([sys.executable, "-m", "tfpar.cli", "plan", *argv],
                               capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
