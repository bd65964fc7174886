"""Python runs of the suite's scripts, started warm.

A fresh ``python script.py`` spends about 2.5 s importing TensorFlow before it
does anything, and the suite starts well over a hundred of them. ``run`` and
``start`` take what ``subprocess.run`` / ``Popen`` take for ``python
script.py ...``, ``python -m module ...`` and ``python -c code ...`` and run it
in a fork of a server that imported TensorFlow, Keras, NumPy, OR-Tools and
networkx once (never tfpar, never a session or an eager context). A server
is started per import environment (the variables TensorFlow, Python and the
numeric libraries read while importing), so a run whose environment would
import them differently gets its own.

The child is a process of its own, as a fresh one would be: the run's argv,
working directory, environment, ``sys.path[0]``, new random seeds, stdin
from /dev/null, stdout and stderr on file descriptors (TensorFlow's C++ log
is captured too), an uncaught exception printed as Python prints it and exit
status 1, ``atexit`` handlers run at the end; a timeout kills it. What only a
cold start can show (which modules an import pulls in, interpreter options,
stdin) stays with ``subprocess``: callers choose this module where a script
merely needs TensorFlow.
"""
import atexit
import importlib
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Dict, List, Optional, Sequence

# Variables read while Python starts or TensorFlow and the numeric libraries are
# imported (TF_CONFIG is read only when a cluster is set up, so it is left out).
_IMPORT_PREFIXES = ("PYTHON", "TF_", "CUDA", "KERAS", "OMP_", "MKL", "OPENBLAS", "LD_", "XLA",
                    "HOME", "TMPDIR")
_RUNTIME_ONLY = ("TF_CONFIG",)
_MAX_SERVERS = 3  # import environments kept warm at once (each holds TensorFlow: ~0.5 GB)


def import_environment(env: Dict[str, str]) -> tuple:
    """The part of ``env`` that decides how a fresh Python imports TensorFlow."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_IMPORT_PREFIXES) and k not in _RUNTIME_ONLY))


class Run:
    """A started run (``start``), read like a ``Popen`` whose output is piped:
    ``communicate`` waits for it and gives (stdout, stderr); ``returncode``."""

    def __init__(self, server: "_Server", args: List[str], pid: int, out: str, err: str,
                 text: bool):
        self._server, self.args, self.pid = server, args, pid
        self._paths, self._text = (out, err), text
        self.returncode: Optional[int] = None

    def communicate(self, timeout: Optional[float] = None):
        reply = self._server.ask({"wait": self.pid, "timeout": timeout})
        out, err = (self._read(path) for path in self._paths)
        if reply["timed_out"]:  # the run is killed, as ``subprocess.run`` kills it
            raise subprocess.TimeoutExpired(self.args, timeout, output=out, stderr=err)
        self.returncode = reply["returncode"]
        return out, err

    def _read(self, path: str):
        with open(path, "rb") as stream:
            data = stream.read()
        os.unlink(path)
        return data.decode(errors="replace") if self._text else data


def start(args: Sequence[str], cwd=None, env=None, text: bool = True):
    """``subprocess.Popen(args, stdout=PIPE, stderr=PIPE, ...)`` for ``args``
    (``[sys.executable, ...]``), warm (a ``Run``) where it can be."""
    args = [str(a) for a in args]
    if not _warm_form(args):
        return subprocess.Popen(args, cwd=cwd, env=env, text=text, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    return _forked(args, cwd, env, text)


def _forked(args: List[str], cwd, env, text: bool) -> Run:
    """``args`` (of ``_warm_form``) started in the server of their environment."""
    env = dict(os.environ if env is None else env)
    server = _server_for(env)
    out, err = (_output_file(kind) for kind in (".out", ".err"))
    reply = server.ask({"start": args[1:], "cwd": os.path.abspath(cwd or os.getcwd()),
                        "env": env, "out": out, "err": err})
    return Run(server, args, reply["pid"], out, err, text)


def _output_file(suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix="warm-python-", suffix=suffix)
    os.close(fd)
    return path


def run(args: Sequence[str], cwd=None, env=None, capture_output: bool = True,
        text: bool = True, timeout: Optional[float] = None, check: bool = False, **kwargs):
    """``subprocess.run(args, capture_output=True, ...)``, warm where it can be."""
    args = [str(a) for a in args]
    if not _warm_form(args) or kwargs or not capture_output:
        return subprocess.run(args, cwd=cwd, env=env, capture_output=capture_output,
                              text=text, timeout=timeout, check=check, **kwargs)
    started = _forked(args, cwd, env, text)
    out, err = started.communicate(timeout)
    done = subprocess.CompletedProcess(started.args, started.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _warm_form(args: List[str]) -> bool:
    """``python script ...``, ``python -m module ...`` or ``python -c code ...``
    of this interpreter, no interpreter options."""
    return (len(args) >= 2 and args[0] == sys.executable
            and (not args[1].startswith("-") or (args[1] in ("-m", "-c") and len(args) >= 3)))


class _Server:
    """One warm server: a subprocess answering JSON lines on its stdin/stdout;
    what it prints itself (TensorFlow's import log) is kept for its failure."""

    def __init__(self, env: Dict[str, str]):
        self._log = tempfile.TemporaryFile()  # pylint: disable=consider-using-with
        self.process = subprocess.Popen([sys.executable, __file__], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log)
        self._lock = threading.Lock()

    def ask(self, request: dict) -> dict:
        with self._lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            self._log.seek(0)
            raise RuntimeError(f"the warm Python server exited ({self.process.wait()}):\n"
                               + self._log.read().decode(errors="replace")[-3000:])
        return json.loads(line)

    def close(self):
        """Ask the server to end (its stdin closes); ``wait`` for it."""
        self._log.close()
        self.process.stdin.close()

    def wait(self):
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def stop(self):
        self.close()
        self.wait()


SERVERS: Dict[tuple, _Server] = {}


def _server_for(env: Dict[str, str]) -> _Server:
    key = import_environment(env)
    if key not in SERVERS or SERVERS[key].process.poll() is not None:
        if len(SERVERS) >= _MAX_SERVERS:
            SERVERS.pop(next(iter(SERVERS))).stop()
        SERVERS[key] = _Server(env)
    else:
        SERVERS[key] = SERVERS.pop(key)  # most recently used last
    return SERVERS[key]


@atexit.register
def stop_servers():
    """All servers asked first, then waited for: they end together."""
    for server in SERVERS.values():
        server.close()
    for server in SERVERS.values():
        server.wait()
    SERVERS.clear()


# --- the server --------------------------------------------------------------

def _preload():
    """What every run would import first, imported once; no TensorFlow runtime
    (eager context, session, thread pools) is started, so forks are clean."""
    for name in ("numpy", "networkx", "ortools.sat.python.cp_model", "tensorflow"):
        importlib.import_module(name)
    tf, context = sys.modules["tensorflow"], sys.modules["tensorflow.python.eager.context"]
    assert tf.keras.layers.Dense  # Keras loads lazily
    assert not context.context()._initialized, (  # pylint: disable=protected-access
        "preloading started TensorFlow's runtime")


def _serve():
    """Answer ``start`` (fork a run: its pid) and ``wait`` (its exit status,
    or timed out: killed, as ``subprocess.run`` kills it) until stdin closes;
    then kill the runs still going and exit at once (the server holds nothing
    to clean up, and tearing its TensorFlow down took about a second)."""
    _preload()
    requests, replies = sys.stdin, sys.stdout
    running = set()
    for line in requests:
        request = json.loads(line)
        if "start" in request:
            replies.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)
            running.add(pid)
            reply = {"pid": pid}
        else:
            reply = _wait(request["wait"], request["timeout"])
            running.discard(request["wait"])
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    for pid in running:
        _kill(pid)
    os._exit(0)  # pylint: disable=protected-access


def _wait(pid: int, timeout: Optional[float]) -> dict:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": False}
        if deadline is not None and time.monotonic() > deadline:
            _kill(pid)
            return {"returncode": None, "timed_out": True}
        time.sleep(0.005)


def _kill(pid: int):
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _child(request: dict):
    """In the fork: become the run, then exit with its status (never returns)."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY),
                               (1, request["out"], os.O_WRONLY | os.O_TRUNC),
                               (2, request["err"], os.O_WRONLY | os.O_TRUNC)):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)  # pylint: disable=consider-using-with  (read ahead)
        random.seed()
        sys.modules["numpy"].random.seed()
        code = _exit_code(request["start"])
    finally:
        try:
            threading._shutdown()  # pylint: disable=protected-access  (as Python's exit does)
            atexit._run_exitfuncs()  # pylint: disable=protected-access
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # pylint: disable=protected-access


def _exit_code(argv: List[str]) -> int:
    """Run ``argv`` (what follows ``python``) as ``__main__``; its exit status."""
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # pylint: disable=exec-used
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:  # pylint: disable=broad-except  (Python prints it and exits 1)
        kind, error, trace = sys.exc_info()
        while trace and trace.tb_frame.f_code.co_filename in _OWN_FRAMES:
            trace = trace.tb_next  # the traceback a fresh Python prints: the run's frames
        sys.excepthook(kind, error.with_traceback(trace), trace)
        return 1
    return 0


# The frames between Python and the run, which a fresh start does not have.
_OWN_FRAMES = (os.path.abspath(__file__), __file__, runpy.__file__, "<frozen runpy>")

if __name__ == "__main__":
    _serve()
