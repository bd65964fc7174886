"""Security of multi-worker runs: what the printed host commands pass, who can
reach the workers' gRPC servers, and what tfpar says when it cannot stop them."""
import ctypes
import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tfpar.runtime import launcher, netns
from tfpar.runtime.launcher import hosts_commands

HOSTILE = ["--name", "two words", "x; touch {marker}", "$(touch {marker})", "it's"]


def test_printed_host_commands_pass_every_argument_whole(tmp_path):
    """Run each printed line with a POSIX shell: the script gets exactly the
    arguments given (spaces, quotes), and nothing of them runs as a command."""
    script = tmp_path / "argv.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps([json.loads(os.environ['TF_CONFIG']), sys.argv[1:]]))\n")
    marker = tmp_path / "injected"
    args = [a.format(marker=marker) for a in HOSTILE]
    text = hosts_commands(["a", "b"], 2222, str(script), args)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    for index, line in enumerate(lines):
        out = subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        config, argv = json.loads(out.stdout)
        assert argv == args
        assert config == {"cluster": {"worker": ["a:2222", "b:2222"]},
                          "task": {"type": "worker", "index": index}}
    assert not marker.exists(), "an argument ran as a shell command"


# Every worker: wh.init (the chief waits for the other, which serves); the chief
# prints the cluster's addresses, waits for the test's go file, then ends.
SERVING = """import json, os, sys, time
import tensorflow as tf
import tfpar as wh
tf.compat.v1.disable_eager_execution()
wh.init({"communication.timeout_s": 30.0})
print("workers", json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def _outside_addresses():
    """This host's addresses as others see them: loopback, and the address of
    the default route's interface if there is one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent
            routed = s.getsockname()[0]
        except OSError:
            routed = None
    return ["127.0.0.1"] + ([routed] if routed and routed != "127.0.0.1" else [])


def _reachable(host, port):
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _private_network_refused():
    """Why this OS refuses the launcher a network namespace (None: it allows one),
    asked in a child process (entering one cannot be undone)."""
    code = ("from tfpar.runtime.netns import enter_private_network as e; r = e(); "
            "print('' if r is None else r)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip() or None


@pytest.mark.slow
@pytest.mark.parametrize("network", ["auto", "host"])
def test_who_can_reach_the_workers_of_a_launch(network, tmp_path):
    """Seen from this process, outside the launch: with a network of their own
    (auto, where the OS allows it) no worker's port answers, on loopback or on
    this host's address, and no worker warns; with the host's network (asked,
    or the OS refused a private one) every port answers, and every worker
    says so before it starts its server."""
    script, go = tmp_path / "serve.py", tmp_path / "go"
    script.write_text(SERVING)
    refused = _private_network_refused()
    proc = subprocess.Popen([sys.executable, "-m", "tfpar.cli", "launch", "--workers", "2",
                             "--devices-per-worker", "1", "--network", network, str(script),
                             str(go)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[worker 0] workers "):
                break
        ports = [int(a.rsplit(":", 1)[1]) for a in json.loads(line.split("workers ", 1)[1])]
        reached = {(h, p): _reachable(h, p) for h in _outside_addresses() for p in ports}
        go.touch()
        lines += proc.communicate(timeout=60)[0].splitlines(keepends=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    warned = [t for t in (0, 1) if f"FallbackWarning: tfpar: a gRPC server for /job:worker/task:{t}"
              in text]
    if network == "auto" and refused is None:
        assert "the workers share a network namespace of their own" in text, text[-3000:]
        assert not any(reached.values()), reached
        assert warned == [], text[-3000:]
    else:
        if network == "auto":
            assert f"a private one was refused: {refused}" in text, text[-3000:]
        assert all(reached.values()), reached
        assert warned == [0, 1], text[-3000:]


def test_a_refused_private_network_is_said(monkeypatch, tmp_path):
    """--network private ends the launch (exit 2) saying why the OS refused;
    auto says it and runs the workers on this host's network."""
    monkeypatch.setattr(netns, "enter_private_network", lambda: "unshare: not allowed here")
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    out = io.StringIO()
    assert launcher.launch(2, str(script), [], network="private", out=out) == 2
    assert out.getvalue() == ("tfpar launch: --network private: cannot give the workers a "
                              "network of their own: unshare: not allowed here\n")
    out = io.StringIO()
    assert launcher.launch(2, str(script), [], network="auto", out=out) == 0
    assert out.getvalue().startswith("tfpar launch: the workers use this host's network, where "
                                     "their gRPC servers are open to anyone who reaches this "
                                     "host: a private one was refused: unshare: not allowed here\n")
    assert "[worker 1] hello" in out.getvalue()


def test_why_a_network_namespace_is_refused_names_the_cause_and_the_way_out(monkeypatch):
    class Libc:
        @staticmethod
        def unshare(flags):
            ctypes.set_errno(errno.EPERM)
            return -1
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = netns.enter_private_network()
    assert why.startswith("unshare(CLONE_NEWUSER|CLONE_NEWNET): Operation not permitted (run as "
                          "root, or allow unprivileged user namespaces"), why


@pytest.mark.slow
def test_strict_refuses_an_open_server_unless_the_network_is_trusted():
    """Chief of a 2-worker TF_CONFIG whose other worker never comes: under
    strict an open server is a PlanError before it starts; with
    cluster.trusted_network it starts (and waits for the other worker in
    vain); without a cluster that key is a ConfigError."""
    ports = launcher._free_ports(2)  # pylint: disable=protected-access
    tf_config = launcher.tf_config([f"127.0.0.1:{p}" for p in ports], 0)
    code = ("import sys, json, tfpar as wh\n"
            "try:\n    wh.init(json.loads(sys.argv[1]))\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    cases = {"strict": ({"strict": True}, tf_config),
             "trusted": ({"strict": True, "cluster.trusted_network": True}, tf_config),
             "alone": ({"cluster.trusted_network": True}, None)}
    procs = {}
    for name, (config, cluster) in cases.items():
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(TFPAR_COMMUNICATION_TIMEOUT_S="2", TFPAR_CLUSTER_NUM_DEVICES="1")
        if cluster:
            env["TF_CONFIG"] = cluster
        procs[name] = subprocess.Popen([sys.executable, "-c", code, json.dumps(config)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}
    assert (f"PlanError tfpar: a gRPC server for /job:worker/task:0 at 127.0.0.1:{ports[0]}: "
            "TensorFlow 2.15 listens on every interface") in out["strict"], out["strict"]
    assert "(strict: true makes this an error)" in out["strict"]
    assert "ClusterError tfpar: worker /job:worker/task:1" in out["trusted"], out["trusted"]
    assert "did not start within 2 s" in out["trusted"]
    assert ("ConfigError config key 'cluster.trusted_network' (True) does nothing in this "
            "process: it needs a TF_CONFIG cluster of 2 or more workers") in out["alone"], \
        out["alone"]


def test_a_namespace_whose_loopback_stays_down_is_not_entered(monkeypatch):
    """unshare succeeds but loopback cannot be brought up (Ubuntu 24.04's
    restricted user namespaces): a forked child found it out, so this process
    stays in its network (one entered could not be left, and its workers could
    not reach one another)."""
    class Libc:
        @staticmethod
        def unshare(flags):
            return 0

    def refused():
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "_loopback_up", refused)
    before = os.readlink("/proc/self/ns/net")
    why = netns.enter_private_network()
    assert why.startswith("unshare(CLONE_NEWNET) succeeded but loopback could not be brought "
                          "up (Operation not permitted)"), why
    assert os.readlink("/proc/self/ns/net") == before


INIT_ONLY = """import tensorflow as tf
import tfpar as wh
tf.compat.v1.disable_eager_execution()
wh.init({"communication.timeout_s": 30.0, "cluster.trusted_network": True})
print("served", flush=True)
"""


@pytest.mark.slow
def test_a_port_taken_before_its_worker_binds_it_is_started_again(monkeypatch, tmp_path):
    """On the host's network another process can take a port between the
    launcher choosing it and the worker binding it: the launch starts again on
    fresh ports, says why, and ends well without spending a restart."""
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    choices = []

    def ports(count, real=launcher._free_ports):  # pylint: disable=protected-access
        fresh = real(count)
        choices.append(fresh if choices else [taken.getsockname()[1]] + fresh[1:])
        return choices[-1]
    monkeypatch.setattr(launcher, "_free_ports", ports)
    script = tmp_path / "init.py"
    script.write_text(INIT_ONLY)
    out = io.StringIO()
    try:
        code = launcher.launch(2, str(script), [], network="host", out=out)
    finally:
        taken.close()
    text = out.getvalue()
    assert code == 0, text[-3000:]
    assert ("tfpar launch: worker 0 could not listen on its port (another process took it after "
            "the launcher chose it): every worker starts again on fresh ports (retry 1 of 3, not "
            "counted as a restart)\n") in text, text[-3000:]
    assert len(choices) == 2 and "[worker 0] served" in text and "restarting" not in text
