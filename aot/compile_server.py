"""A warm compiler behind the build's ninja edges: one process that has imported Triton forks a
child per binary, so an edge skips what a fresh process pays before compiling anything (Python's
start, Triton's import, and Triton's per-process setup: it hashes its own ~500 MB library into
every cache key and asks ptxas its version).

    python -m aot.compile_server SOCKET TARGET...      (started and stopped by `python -m aot`)

ninja still runs one `python -m aot.compile_one` edge per binary, so its progress line and its
incremental rebuilds are unchanged. That process imports no Triton: it finds the server through
SERVER_ENV, sends it the edge's arguments and waits. Without a server, or when the server does
not serve (another environment, a failure, a crashed child), the edge compiles in its own
process as it always did: the outputs never depend on the server.

Each request gets a child forked from the warmed state, in which nothing has been compiled: the
compile starts from the state a fresh process would reach (Triton's JIT caches hashes on first
use), and a compiler crash ends that child only.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER_ENV = "FLEXPLAN_AOT_COMPILE_SERVER"
# Set per process by the shell ninja runs commands in, or by this protocol: not compile inputs.
_NOT_COMPARED = {SERVER_ENV, "PWD", "OLDPWD", "SHLVL", "_"}


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _NOT_COMPARED}


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def _receive(conn: socket.socket) -> dict | None:
    with conn.makefile("rb") as stream:
        line = stream.readline()
    return json.loads(line) if line.endswith(b"\n") else None  # None: the peer ended first


# ---------------------------------------------------------------- the edge's side


def compile_remotely(spec: str, entry: str) -> bool:
    """Have the server compile this edge; False when the caller must compile it itself."""
    path = os.environ.get(SERVER_ENV)
    if not path:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            _send(conn, {"spec": spec, "entry": entry, "cwd": os.getcwd(), "env": _environment()})
            reply = _receive(conn)
    except OSError:
        return False  # no server (a manual ninja run, a stopped build): compile here
    if reply is None:
        print("aot: the compile server's child ended without a reply; compiling here", file=sys.stderr)
        return False
    sys.stdout.write(reply.get("stdout", ""))  # what the compile printed, shown with this edge
    if reply["status"] != "done":
        print(f"aot: compile server: {reply['reason']}; compiling here", file=sys.stderr)
        return False
    return True


# ---------------------------------------------------------------- python -m aot's side


class CompileServer:
    """The build's handle on its server: started first, so that its warm-up overlaps the
    enumeration of the variants, handed to ninja's edges, stopped when ninja is done."""

    def __init__(self, out: Path, targets: list[str], env: dict):
        self._dir = tempfile.mkdtemp(prefix="flexplan-aot-")  # short: a socket path has ~100 bytes
        self.path = os.path.join(self._dir, "compile.sock")
        self._env = env
        # The edges' own directory and environment: the server's children compile as they would.
        self._proc = subprocess.Popen([sys.executable, "-m", "aot.compile_server", self.path, *targets],
                                      cwd=out, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)

    def ninja_env(self) -> dict | None:
        """The environment for ninja, naming the server once it is ready; None if it failed."""
        if self._proc.stdout.readline() != b"ready\n":
            print("aot: the compile server did not start; each binary compiles in its own process",
                  file=sys.stderr)
            return None
        return {**self._env, SERVER_ENV: self.path}

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait()
        self._proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------- the server's side


def warm_up(targets: list[str]) -> None:
    """Pay once what every compile would pay first: the modules compile_spec imports and
    process-wide caches that do not depend on the kernel. No kernel module is imported (a child
    imports its kernel's source as it is on disk then) and nothing is compiled."""
    import aot.compile_one  # noqa: F401 (its module setup: no interpreter, the warning filter)
    import triton  # noqa: F401
    from triton.compiler import ASTSource  # noqa: F401
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    from flexplan.aot.keys import gpu_target
    from flexplan.aot.kernel_params import ptx_param_bytes  # noqa: F401

    triton_key()  # lru-cached: a hash of Triton's sources and of its ~400-500 MB libtriton
    for target in targets:
        try:  # CUDA: runs `ptxas --version` (lru-cached)
            make_backend(gpu_target(target)).hash()
        except Exception:  # noqa: BLE001 (the compiles meet it again and record it per variant)
            pass


def _serve_one(conn: socket.socket) -> None:
    """In a forked child: compile one edge, reply, with the compile's output captured."""
    request = _receive(conn)
    if request is None:
        return
    if request["env"] != _environment():
        differ = sorted(set(request["env"].items()) ^ set(_environment().items()))
        _send(conn, {"status": "fallback", "reason": f"environment differs ({differ[0][0]}, ...)"})
        return
    os.chdir(request["cwd"])
    with tempfile.TemporaryFile() as captured:
        # Both streams into one file, at the descriptor level (ptxas' and LLVM's output too).
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(captured.fileno(), 1), os.dup2(captured.fileno(), 2)
        reply = {"status": "done"}
        try:
            from aot.compile_one import compile_spec, read_spec

            compile_spec(read_spec(request["spec"]), Path(request["entry"]))
        except BaseException as exc:  # SystemExit too: the edge redoes it and fails as it would
            reply = {"status": "fallback", "reason": f"{exc.__class__.__name__}: {exc}"[:300]}
        sys.stdout.flush(), sys.stderr.flush()
        captured.seek(0)
        reply["stdout"] = captured.read().decode(errors="replace")
    _send(conn, reply)


def _fork_child(listener: socket.socket, conn: socket.socket) -> None:
    if os.fork() == 0:
        code = 1
        try:
            listener.close()
            _serve_one(conn)
            code = 0
        finally:
            os._exit(code)  # never back into the server's loop, nor its atexit handlers
    conn.close()


def _reap() -> None:
    """Collect finished children (not SIG_IGN on SIGCHLD: children inherit it, and subprocess
    then reads every ptxas exit status as 0)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _threads() -> int:
    """Threads of this process, native ones included (Linux); 1 where it cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve(path: str, targets: list[str]) -> None:
    warm_up(targets)
    if _threads() > 1:  # a fork copies only the calling thread: locks held by others stay held
        print("aot: compile server not started: importing Triton started threads", file=sys.stderr)
        return  # no "ready": python -m aot runs the edges without a server
    parent = os.getppid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(256)  # ninja's -j edges connect at once
        listener.settimeout(1.0)
        print("ready", flush=True)  # python -m aot starts ninja after this line
        while os.getppid() == parent:  # ends with the build, even one killed without stopping it
            _reap()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            _fork_child(listener, conn)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        serve(argv[0], argv[1:])
    except KeyboardInterrupt:  # Ctrl-C reaches the whole build; ninja says it was interrupted
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
