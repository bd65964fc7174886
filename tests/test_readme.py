"""The documentation (README.md and every page of docs/) cannot drift: its
snippets run, its commands exist with the flags they name, its sample outputs
match what the commands print, the Troubleshooting page quotes the messages
tfpar really raises, the Configuration page's table lists the keys ``tfpar
config`` knows, and every page is reachable from README.

The pages are found on disk, so a new docs/*.md is checked as soon as it
exists. Every fenced block of a page carries a marker comment on the line above it:
``<!-- readme-test: run FIXTURE -->`` (a Python snippet completed by
``FIXTURES[FIXTURE]``), ``<!-- readme-test: commands -->`` (one command per
line), ``<!-- readme-test: output of `COMMAND` -->`` (what COMMAND prints,
numbers and ``...`` standing for anything) or ``<!-- readme-test: plan json
-->`` (a plan JSON, which ``test_plan.py`` reads and pins). The docstrings of examples/ and
benchmarks/ give their usage lines, checked like the pages' commands.
"""
import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

from tfpar import config_schema as tfpar_config
from tfpar import errors
import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 260
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
           TF_CPP_MIN_LOG_LEVEL="2")
MARKER = re.compile(r"<!-- readme-test: (run (?P<fixture>\w+)|commands|output of `(?P<of>[^`]+)`"
                    r"|plan json) -->")
COMMAND_WORDS = ("python ", "tfpar ", "make ", "horovodrun ", "TEST_REWRITE_OFF=1 ")


@dataclasses.dataclass
class Block:
    page: str       # path from the repository's root
    line: int       # 1-based line of the opening fence
    marker: str     # the marker comment's text ("" when missing)
    body: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> List[str]:
    """README.md, then every docs/*.md, as paths from the repository's root."""
    docs = sorted(f"docs/{n}" for n in os.listdir(DOCS) if n.endswith(".md")) if os.path.isdir(DOCS) else []
    return ["README.md"] + docs


def page_text(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def readme_text() -> str:
    return page_text("README.md")


def fenced_blocks(page: str) -> List[Block]:
    lines, blocks, i = page_text(page).split("\n"), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = lines.index("```", i + 1)
            marker = lines[i - 1] if i and lines[i - 1].startswith("<!--") else ""
            blocks.append(Block(page, i + 1, marker, "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return blocks


def blocks_of(kind: str) -> List[Tuple[re.Match, Block]]:
    found = [(MARKER.fullmatch(b.marker), b) for page in pages() for b in fenced_blocks(page)]
    return [(m, b) for m, b in found if m and m.group(0).startswith(f"<!-- readme-test: {kind}")]


def test_every_block_has_a_marker():
    bad = [b.where for page in pages() for b in fenced_blocks(page) if not MARKER.fullmatch(b.marker)]
    assert not bad, f"blocks at {bad} lack a readme-test marker (see this file)"


def test_readme_is_short():
    lines = readme_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to a docs/ page"


def linked_pages(page: str) -> List[str]:
    """The pages of this repository a page links to (relative Markdown links)."""
    targets = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", page_text(page))
    return [os.path.normpath(os.path.join(os.path.dirname(page), t)) for t in targets
            if "://" not in t]


def test_every_docs_page_is_reachable_from_readme():
    seen, todo = set(), ["README.md"]
    while todo:
        page = todo.pop()
        if page not in seen and os.path.isfile(os.path.join(ROOT, page)):
            seen.add(page)
            todo += linked_pages(page)
    unreachable = [p for p in pages() if p not in seen]
    assert not unreachable, f"no link from README.md (or a page it links) leads to {unreachable}"


def test_relative_links_lead_to_files():
    broken = []
    for page in pages():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page_text(page)):
            path = os.path.join(ROOT, os.path.dirname(page), target)
            if "://" not in target and not os.path.exists(path):
                broken.append(f"{page} -> {target}")
    assert not broken, broken


def test_readme_starts_with_the_title_and_the_two_commands():
    text = readme_text()
    assert text.startswith("# tfpar\n\n<!-- readme-test: commands -->\n```\nmake demo\nmake test\n```\n"), text[:80]


# -- Python snippets ------------------------------------------------------------

# A fixture completes a snippet where it elides data: ``before`` runs before it
# (no TensorFlow op there: the snippet calls wh.init first), ``after_init``
# right after its ``wh.init(...)`` line, ``after`` once it ran, asserting where
# the step ran.
GRAPH_CHECK = """
with tf.compat.v1.Session() as traced:
    traced.run(tf.compat.v1.global_variables_initializer())
    metadata = tf.compat.v1.RunMetadata()
    traced.run({fetch}, {feed}, run_metadata=metadata, options=tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
ran = wh.step_devices(metadata)
for name, devices in {expected!r}.items():
    assert sorted(ran.get(name, {{}})) == devices, (name, ran)
print("ran:", ran)
"""
FIXTURES: Dict[str, Dict[str, str]] = {
    "tf2_loop": {
        "before": "import numpy as np\n"
                  "class LazyDataset:  # makes its tf.data ops only when iterated\n"
                  "    def __iter__(self):\n"
                  "        rng = np.random.RandomState(0)\n"
                  "        x = rng.randn(256, 32).astype('float32'); y = rng.randint(0, 10, 256)\n"
                  "        return iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(64))\n"
                  "dataset = LazyDataset()\n",
        "after_init": "from tensorflow.python.eager import context\n"
                      "context.context().enable_run_metadata()\n",
        "after": "import sys\nsys.path.insert(0, {tests})\n"
                 "from tf2_script import working_devices\n"
                 "ran = working_devices(context.context().export_run_metadata())\n"
                 "assert [d.rsplit('/', 1)[-1] for d in ran] == "
                 "['device:CPU:0', 'device:CPU:1', 'device:CPU:2', 'device:CPU:3'], ran\n"
                 "assert np.isfinite(float(loss))\nprint('ran:', ran)\n",
    },
    "tf2_fit": {
        "before": "import numpy as np\nrng = np.random.RandomState(0)\n"
                  "images = rng.randn(128, 784).astype('float32')\n"
                  "labels = rng.randint(0, 10_000, 128)\n",
        "after_init": "from tensorflow.python.eager import context\n"
                      "context.context().enable_run_metadata()\n",
        "after": "import sys\nsys.path.insert(0, {tests})\n"
                 "from tf2_script import working_devices\n"
                 "ran = working_devices(context.context().export_run_metadata())\n"
                 "assert len(ran) == 4, ran\n"
                 "kinds = [(tg.strategy, len(tg.devices)) for tg in wh.current_plan().task_graphs]\n"
                 "assert kinds == [('replicate', 4), ('split', 4)], kinds\n"
                 "assert [w.device[-5:] for w in model.layers[-1].kernel] == "
                 "['CPU:0', 'CPU:1', 'CPU:2', 'CPU:3']\nprint('ran:', ran)\n",
    },
    "graph_mlp": {
        "before": "import numpy as np\nrng = np.random.RandomState(0)\n"
                  "batch_x = rng.randn(64, 32).astype('float32'); batch_y = rng.randint(0, 10, 64)\n",
        "after": GRAPH_CHECK.format(fetch="train_op", feed="{x: batch_x, y: batch_y}",
                                    expected={"replicate_all": ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]}),
    },
    "whale_example_2": {
        "before": "import numpy as np\nimport tensorflow as tf\nimport tfpar as wh\n"
                  "tf.compat.v1.disable_eager_execution()\n"
                  "def backbone(images):\n"
                  "    return tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(images), 64, tf.nn.relu)\n",
        "after_init": "images = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 3])\n"
                      "labels = tf.compat.v1.placeholder(tf.int64, [None])\n",
        "after": "rng = np.random.RandomState(0)\n" + GRAPH_CHECK.format(
            fetch="train_op",
            feed="{images: rng.randn(16, 8, 8, 3), labels: rng.randint(0, 100000, 16)}",
            expected={"replicate_0": ["CPU:0", "CPU:1", "CPU:2", "CPU:3"],
                      "split_1": ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]}),
    },
    "whale_example_1": {
        "before": "import numpy as np\nimport tensorflow as tf\nimport tfpar as wh\n"
                  "tf.compat.v1.disable_eager_execution()\n"
                  "def stage_one(x):\n"
                  "    return tf.compat.v1.layers.dense(x, 16, tf.nn.relu)\n"
                  "def stage_two(h, y):\n"
                  "    logits = tf.compat.v1.layers.dense(h, 10)\n"
                  "    return tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)\n",
        "after_init": "x = tf.compat.v1.placeholder(tf.float32, [None, 32])\n"
                      "y = tf.compat.v1.placeholder(tf.int64, [None])\n",
        "after": "rng = np.random.RandomState(0)\n" + GRAPH_CHECK.format(
            fetch="train_op",
            feed="{x: rng.randn(16, 32), y: rng.randint(0, 10, 16)}",
            expected={"replicate_0": ["CPU:0"], "replicate_1": ["CPU:1"]}),
    },
    "retuned_pipeline": {
        "before": "import numpy as np\nimport tensorflow as tf\nimport tfpar as wh\n"
                  "tf.compat.v1.disable_eager_execution()\n",
        "after_init": "x = tf.compat.v1.placeholder(tf.float32, [None, 16])\n"
                      "y = tf.compat.v1.placeholder(tf.int64, [None])\n"
                      "h = x\n"
                      "for s in range(4):\n"
                      "    with wh.replicate(1):\n"
                      "        h = tf.compat.v1.layers.dense(h, 16, tf.nn.tanh)\n"
                      "loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(\n"
                      "    y, tf.compat.v1.layers.dense(h, 10))\n"
                      "sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)\n"
                      "train_op = sgd.minimize(loss)\n",
        "after": "rng = np.random.RandomState(0)\n"
                 "assert isinstance(wh.current_plan().group_size, int)\n" + GRAPH_CHECK.format(
            fetch="train_op",
            feed="{x: rng.randn(32, 16), y: rng.randint(0, 10, 32)}",
            expected={f"replicate_{s}": [f"CPU:{s}"] for s in range(4)}),
    },
}


def completed(snippet: str, fixture: Dict[str, str]) -> str:
    """The snippet with the fixture's code around it and after its wh.init line."""
    tests = os.path.join(ROOT, "tests")
    lines = snippet.split("\n")
    init = next(i for i, line in enumerate(lines) if line.startswith("wh.init("))
    after_init = fixture.get("after_init", "").replace("{tests}", repr(tests))
    body = "\n".join(lines[:init + 1] + [after_init] + lines[init + 1:])
    return "\n".join([fixture.get("before", ""), body, fixture["after"].replace("{tests}", repr(tests))])


def python_snippets():
    """Each snippet once: README repeats a few of the pages' snippets."""
    first = {}
    for m, b in blocks_of("run"):
        first.setdefault((m.group("fixture"), b.body), b)
    return [pytest.param(fixture, body, id=f"{b.where}-{fixture}") for (fixture, body), b in first.items()]


@pytest.mark.parametrize("fixture,snippet", python_snippets())
def test_python_snippet_runs_and_its_plan_ran(fixture, snippet, tmp_path):
    assert fixture in FIXTURES, f"a page names an unknown fixture {fixture!r}"
    script = tmp_path / "snippet.py"
    script.write_text(completed(snippet, FIXTURES[fixture]))
    # Run where the files a snippet writes (a plan report) stay out of the tree.
    done = warm_python.run([sys.executable, str(script)], cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, script.read_text() + "\n" + done.stderr[-3000:]
    assert "ran:" in done.stdout


# -- Commands ---------------------------------------------------------------------

# Concrete values for the placeholders usage lines show.
PLACEHOLDERS = {"script.py": "examples/data_parallel_mlp.py", "train.py": "examples/data_parallel_mlp.py",
                "P": "4", "M": "8", "K": "2", "F": "1", "B": "2", "T": "0", "N": "2",
                "FILE": "/tmp/readme_plan.json", "out.json": "/tmp/readme_trace.json",
                "CFG": '{"cluster.num_devices": 2}', "h1,h2": "host1,host2", "DIR": "/tmp/readme_traces"}
# Commands cheap enough to run in full (the examples run in full in test_structure.py,
# the benchmarks' --check logic in test_benchmark_checks.py).
# Run, not only checked against --help. ``tfpar plan --model`` is run by its
# output block and tests/test_plan_command_models.py: GPT-3's graph, the
# headline command of docs/planning-a-cluster.md, takes 2 minutes to build.
RUN_IN_FULL = re.compile(r"^tfpar (config|simulate|plan(?! --model)|launch --hosts)\b")


def inline_commands(text: str) -> List[str]:
    """Code spans outside fenced blocks that are commands."""
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", outside)
    return [s for s in spans if s.startswith(COMMAND_WORDS) and not s.split()[1].endswith(":")]


def readme_commands() -> List[str]:
    """The commands of every page: fenced command blocks and code spans."""
    fenced = [line.split("  #")[0].strip() for _, b in blocks_of("commands")
              for line in b.body.split("\n") if line.strip()]
    spans = [c for page in pages() for c in inline_commands(page_text(page))]
    return sorted(set(fenced + spans))


def docstring_commands() -> List[str]:
    """Usage lines of examples/ and benchmarks/ (``python <its path> ...``),
    with their indented continuation lines."""
    found = []
    for folder in ("examples", "benchmarks"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = f"{folder}/{name}"
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
            match = re.search(rf"^( +)python {re.escape(path)}\b.*(\n\1 +\S.*)*", text, re.M)
            if match:
                found.append(" ".join(match.group(0).split()))
    return found


def usage_flags(command: str) -> List[str]:
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", command)


def concrete(command: str) -> List[str]:
    """The usage line as a command to run: optional groups dropped, placeholders filled."""
    words = shlex.split(re.sub(r"\[[^\]]*\]", " ", command))
    return [PLACEHOLDERS.get(w, w.split("|")[0]) for w in words]


def help_command(words: List[str]) -> List[str]:
    """The command that prints the help naming this command's flags."""
    while words and "=" in words[0]:
        words = words[1:]
    if words[0] == "python" and words[1] == "-m":
        return [sys.executable, "-m", words[2], "--help"]
    if words[0] == "python":
        return [sys.executable, words[1], "--help"]
    if words[0] == "tfpar":
        return [sys.executable, "-m", "tfpar.cli", words[1], "--help"]
    return [os.path.join(BIN, words[0]), "--help"]


def all_commands():
    """The pages' commands and the docstrings' usage lines, each once."""
    commands = sorted(set(readme_commands() + docstring_commands()))
    return [pytest.param(c, id=c[:60], marks=[pytest.mark.horovod] if "horovod" in c else [])
            for c in commands if not c.startswith("make ")]


@functools.lru_cache(maxsize=None)
def help_of(command: tuple) -> subprocess.CompletedProcess:
    """What ``command`` (a ``--help``) printed, run once per process (59 usage
    lines name 24 commands)."""
    return warm_python.run(list(command), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=120)


@pytest.mark.parametrize("command", all_commands())
def test_command_exists_with_the_flags_it_names(command):
    words = concrete(command)
    for word in words:
        if re.fullmatch(r"[\w/]+\.py", word) and not word.startswith("/"):
            assert os.path.exists(os.path.join(ROOT, word)), f"{command}: no {word}"
    for name in re.findall(r"^(\w+)=", command):
        assert subprocess.run(["git", "grep", "-q", name, "--", "tests", "tfpar"], cwd=ROOT).returncode == 0, name
    done = help_of(tuple(help_command(words)))
    assert done.returncode == 0, f"{command}:\n{done.stderr[-2000:]}"
    missing = [f for f in usage_flags(command) if f not in done.stdout]
    assert not missing, f"{command}: its --help does not know {missing}"
    if RUN_IN_FULL.match(command):
        run = warm_python.run([sys.executable, "-m", "tfpar.cli", *words[1:]], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{command}:\n{run.stderr[-2000:]}"


def test_make_targets_exist():
    targets = {c.split()[1] for c in readme_commands() if c.startswith("make ")}
    assert {"demo", "test"} <= targets
    for target in targets:
        done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"make {target}: {done.stderr}"


# -- Sample outputs ---------------------------------------------------------------

def line_pattern(line: str) -> str:
    """A sample output line as a regex: numbers match numbers, ``...``
    anything, two spaces or more (a table's column gap, which a number of
    another width moves) two or more."""
    parts = re.split(r"(\.\.\.|\d+(?:\.\d+)?| {2,})", line.rstrip())
    return "".join(".*" if p == "..." else r"\d+(?:\.\d+)?" if p and p[0].isdigit()
                   else " {2,}" if p.startswith("  ") else re.escape(p) for p in parts)


def output_blocks():
    """Per command, every sample of it: each command runs once, however many pages show it."""
    samples: Dict[str, List[Block]] = {}
    for m, b in blocks_of("output"):
        samples.setdefault(m.group("of"), []).append(b)
    return [pytest.param(command, blocks, id=blocks[0].where) for command, blocks in samples.items()]


@pytest.mark.parametrize("command,samples", output_blocks())
def test_sample_output_matches_the_command(command, samples):
    words = concrete(command)
    done = warm_python.run([sys.executable, *words[1:]], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = (done.stdout + "\n" + done.stderr).split("\n")
    for block in samples:
        for line in filter(str.strip, block.body.split("\n")):
            if line.startswith("$ "):
                assert concrete(line[2:]) == words, f"{block.where} shows {line[2:]}, its marker {command}"
                continue
            pattern = re.compile(line_pattern(line))
            assert any(pattern.fullmatch(p.rstrip()) for p in printed), \
                f"{block.where}: {line!r} is not in what `{command}` prints:\n" + "\n".join(printed[-60:])


# -- Troubleshooting and configuration ---------------------------------------------

def section(title: str) -> str:
    """The page whose title is ``# title``."""
    found = [page_text(p) for p in pages() if page_text(p).startswith(f"# {title}\n")]
    assert len(found) == 1, f"{len(found)} pages are titled {title!r}"
    return found[0]


def tfpar_sources() -> str:
    chunks = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tfpar")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    chunks.append(f.read())
    return "\n".join(chunks)


def test_troubleshooting_quotes_real_messages_and_names_every_error_class():
    rows = [r for r in section("Troubleshooting").split("\n") if r.startswith("| ") and "---" not in r][1:]
    assert len(rows) >= 10
    # Source strings are split over lines: compare with the quotes and line breaks taken out.
    sources = re.sub(r'"\s*\n\s*f?"', "", tfpar_sources())
    for row in rows:
        message = re.search(r"`([^`]+)`", row.split(" | ")[0]).group(1)
        for fragment in filter(None, (f.strip() for f in message.split("..."))):
            assert fragment in sources, f"Troubleshooting quotes {fragment!r}, which tfpar never says"
    named = section("Troubleshooting")
    for name in errors.__all__:
        assert f"`{name}`" in named or f"`tfpar.{name}`" in named, f"Troubleshooting lacks {name}"


def test_configuration_table_lists_every_key_with_its_default():
    rows = re.findall(r"^\| `([a-z_.]+)` \| ([^|]+) \|", section("Configuration"), re.M)
    documented = dict(rows)
    keys = tfpar_config.SCHEMA
    assert set(documented) == set(keys), (set(keys) - set(documented), set(documented) - set(keys))
    for key, option in keys.items():
        shown, default = documented[key].strip().strip("`"), option.default
        if isinstance(default, bool):
            assert shown == str(default).lower(), (key, shown, default)
        elif isinstance(default, (int, float)):
            assert float(shown) == default, (key, shown, default)
        elif isinstance(default, str):
            assert shown == default, (key, shown, default)
