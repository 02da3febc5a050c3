"""The child side of `topp_rl.tasks.sandbox`, run as `python -I -B -c <this file's source> SETTINGS_JSON` (confined,
inside bwrap, where nothing of the repository is mounted), the code to run on stdin. It sets its resource limits,
inherited by every process it starts, then runs the code with its own frames only in a traceback:
- address space (RLIMIT_AS): an allocation past `memory_bytes` raises MemoryError (confined, the call's cgroup also
  bounds all processes together);
- unconfined only: CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later) and the largest file
  (RLIMIT_FSIZE); confined, the call's cgroup bounds the CPU time and a sized tmpfs the files;
- no core files.
This file imports only the standard library: it runs under the base interpreter, without the project's packages.
"""

import json
import linecache
import os
import resource
import sys
import traceback


def set_limits(settings: dict) -> None:
    memory = int(settings["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if "cpu_s" in settings:
        cpu = int(settings["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if "file_bytes" in settings:
        file_bytes = int(settings["file_bytes"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


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
    set_limits(settings)
    os.chdir(settings["cwd"])
    status = run(code)
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
