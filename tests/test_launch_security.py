"""Security of multi-worker runs: what the printed host commands pass, who can
reach the workers' gRPC servers, and what tfpar says when it cannot stop them."""
import json
import os
import subprocess
import sys

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
