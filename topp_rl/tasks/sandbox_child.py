"""The child side of `topp_rl.tasks.sandbox`: run as a script (`python -I -B sandbox_child.py SETTINGS_JSON`), the
code to run on stdin. It limits itself, then runs the code:

1. no network: `unshare(CLONE_NEWUSER | CLONE_NEWNET)` (a network namespace of its own, without interfaces
   that are up) when the settings say `"network": "netns"` (it exits with status 97 if that fails: never runs
   unconfined), else an audit hook that refuses socket connects, binds, sends and name look-ups;
2. resource limits, inherited by every child process: CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second
   later), address space (RLIMIT_AS: allocations fail with MemoryError), file size, no core files;
3. cwd = the call's scratch dir, and an audit hook that refuses opening a file for writing outside it, removing,
   renaming, linking or changing files outside it, starting other programs (they would run without the hook)
   and loading libraries with ctypes.

Audit hooks confine Python code that plays by the rules; they are not a security boundary (docs/agents.md).
This file imports only the standard library: it runs before (and without) the project's packages.
"""

import ctypes
import json
import linecache
import os
import resource
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
NETNS_FAILED = 97  # the exit status when the settings ask for a network namespace and unshare fails

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate",
                "os.mkfifo", "os.mknod", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr"}
_TWO_PATH_EVENTS = {"os.rename", "os.link", "os.symlink"}
_PROGRAM_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn",
                   "os.startfile", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function"}
_SOCKET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                  "socket.gethostbyname", "socket.gethostbyaddr", "socket.gethostbyname_ex"}


def isolate_network() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        sys.stderr.write(f"sandbox: unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: "
                         f"{os.strerror(ctypes.get_errno())}\n")
        sys.exit(NETNS_FAILED)


def set_limits(settings: dict) -> None:
    cpu = int(settings["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(settings["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_bytes = int(settings["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def make_hook(scratch: str, *, block_sockets: bool):
    root = os.path.realpath(scratch)
    realpath, fspath, join = os.path.realpath, os.fspath, os.path.join

    def inside(path) -> bool:
        if isinstance(path, int):  # an open file descriptor (dir_fd-relative calls name the path separately)
            return True
        full = realpath(join(root, fspath(path).decode() if isinstance(path, bytes) else fspath(path)))
        return full == root or full.startswith(root + os.sep)

    def refuse(event: str, path=None) -> None:
        where = "" if path is None else f" ({path!r} is outside the scratch dir {root})"
        raise PermissionError(f"the sandbox refuses {event}{where}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writes and path is not None and not inside(path):
                refuse("opening a file for writing", path)
        elif event in _PATH_EVENTS:
            if not inside(args[0]):
                refuse(event, args[0])
        elif event in _TWO_PATH_EVENTS:
            for path in args[:2]:
                if not inside(path):
                    refuse(event, path)
        elif event in _PROGRAM_EVENTS:
            refuse(f"{event} (only Python code runs here)")
        elif block_sockets and event in _SOCKET_EVENTS:
            refuse(f"{event} (no network)")

    return hook


def run(code: str) -> int:
    linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")  # source lines in tracebacks
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:  # shown to the model: the code's own frames (the last 8), not this runner's
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<tool>"][-8:]
        head = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
        sys.stderr.write("".join([*head, *traceback.format_exception_only(type(e), e)]))
        return 1
    return 0


def main() -> int:
    settings = json.loads(sys.argv[1])
    code = sys.stdin.read()
    if settings["network"] == "netns":
        isolate_network()
    set_limits(settings)
    os.chdir(settings["scratch"])
    sys.addaudithook(make_hook(settings["scratch"], block_sockets=settings["network"] != "netns"))
    status = run(code)
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
