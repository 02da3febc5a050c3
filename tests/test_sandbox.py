"""The sandbox of task=python_tool (topp_rl/tasks/sandbox.py): each outcome, and each limit holding, on real child
processes (no model needed)."""

import asyncio
import os
import socket
import tempfile
import time

import pytest

from topp_rl.tasks.sandbox import Outcome, SandboxLimits, network_isolation, run_python

FAST = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=10.0, output_bytes=512)


def run(code: str, limits: SandboxLimits = FAST, **kwargs):
    return asyncio.run(run_python(code, limits, **kwargs))


def test_code_runs_and_its_output_comes_back():
    result = run("import math\nprint(37 + 48)\nprint(math.factorial(5))")
    assert (result.outcome, result.stdout, result.stderr, result.exit_code) == (Outcome.OK, "85\n120\n", "", 0)
    assert result.network == network_isolation()


def test_an_exception_is_an_error_with_the_codes_own_traceback():
    result = run("x = 1\ny = x / 0")
    assert result.outcome == Outcome.ERROR and result.exit_code == 1
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"<tool>\", line 2, in <module>\n")
    assert result.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert "sandbox_child" not in result.stderr  # the runner's frames are not shown
    syntax = run("print(")
    assert syntax.outcome == Outcome.ERROR and "SyntaxError" in syntax.stderr
    assert run("import sys; sys.exit(3)").exit_code == 3


def test_the_wall_timeout_kills_the_whole_group():
    # The child forks a sleeper and both sleep: past wall_s the group goes, the sleeper with it.
    code = "import os, time\npid = os.fork()\nprint(pid if pid else os.getpid(), flush=True)\ntime.sleep(60)"
    start = time.monotonic()
    result = run(code, SandboxLimits(cpu_s=5, wall_s=1.5, output_bytes=512))
    assert result.outcome == Outcome.TIMEOUT and result.exit_code is None
    assert 1.5 <= time.monotonic() - start < 30  # not the sleepers' 60 s
    pids = [int(line) for line in result.stdout.split()]
    assert len(pids) == 2
    _wait_gone(pids)


def test_processes_left_behind_are_killed_when_the_code_exits():
    # A fork-bomb-ish child: 20 processes that would sleep a minute; the parent exits at once.
    code = ("import os, time\nfor _ in range(20):\n    pid = os.fork()\n    if pid == 0:\n"
            "        time.sleep(60)\n        os._exit(0)\n    print(pid, flush=True)")
    result = run(code)
    assert result.outcome == Outcome.OK
    pids = [int(line) for line in result.stdout.split()]
    assert len(pids) == 20
    _wait_gone(pids)


def test_a_process_that_leaves_the_group_does_not_hang_the_call():
    """A documented hole: setsid takes a process out of the group, so the kill misses it; it holds the pipes open,
    and the call still returns (after wall_s), with the output read so far."""
    code = ("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n"
            "    os.write(w, b'x')\n    time.sleep(120)\nos.read(r, 1)")  # the parent exits once the child left
    start = time.monotonic()
    result = run(code, SandboxLimits(cpu_s=5, wall_s=2.0))
    try:
        assert result.outcome == Outcome.OK and time.monotonic() - start < 30  # not the escapee's 120 s
        assert _running(int(result.stdout))  # it escaped the kill (docs/agents.md says so)
    finally:
        if result.stdout.strip():
            os.kill(int(result.stdout), 9)


def test_a_cpu_loop_is_stopped_by_its_cpu_limit():
    result = run("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30.0))
    assert result.outcome == Outcome.CPU_LIMIT and result.wall_s < 30


def test_a_memory_hog_fails_with_memory_error():
    result = run("blob = bytearray(1024 ** 3)\nprint('allocated')")
    assert result.outcome == Outcome.ERROR and result.stdout == ""
    assert result.stderr.endswith("MemoryError\n")


def test_too_much_output_is_cut_marked_and_stops_the_code():
    result = run("import sys\nfor _ in range(10 ** 9):\n    sys.stdout.write('x' * 1000)")
    assert result.outcome == Outcome.OUTPUT_LIMIT and result.exit_code is None
    assert result.stdout == "x" * 512 + "\n[output cut at 512 bytes]"
    noisy = run("import sys\nsys.stderr.write('e' * 2000)\nprint('done')")  # stderr is cut, not stopped
    assert noisy.outcome == Outcome.OK and noisy.stdout == "done\n"
    assert noisy.stderr == "[output cut: its first 1488 bytes dropped]\n" + "e" * 512


@pytest.mark.parametrize("network", ["netns", "audit_hook"])
def test_a_connect_fails(network):
    if network == "netns" and network_isolation() != "netns":
        pytest.skip("this machine gives no user + network namespace to an unprivileged child")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.setblocking(False)
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')"
        result = run(code, network=network)
        assert result.outcome == Outcome.ERROR and "connected" not in result.stdout
        expected = "Network is unreachable" if network == "netns" else "PermissionError: the sandbox refuses socket"
        assert expected in result.stderr
        with pytest.raises(BlockingIOError):  # nothing reached the server
            server.accept()
    assert result.network == network


def test_writes_outside_the_scratch_dir_fail(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("kept")
    for code in (f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
                 f"open({str(outside)!r}, 'a').write('x')",
                 f"import os\nos.open({str(tmp_path / 'raw.txt')!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os\nos.remove({str(outside)!r})",
                 f"import os\nos.rename({str(outside)!r}, 'here.txt')",
                 f"import os\nos.symlink({str(outside)!r}, 'link.txt')",
                 "open('../escape.txt', 'w').write('x')"):
        result = run(code)
        assert result.outcome == Outcome.ERROR and "PermissionError: the sandbox refuses" in result.stderr, code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt"] and outside.read_text() == "kept"
    inside = run("import os\nopen('a.txt', 'w').write('hello')\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
                 "print(open('d/b.txt').read(), os.getcwd() == os.environ['HOME'])")
    assert (inside.outcome, inside.stdout) == (Outcome.OK, "hello True\n")


def test_other_programs_and_ctypes_are_refused():
    for code, event in (("import os\nos.system('true')", "os.system"),
                        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
                        ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
                        ("import ctypes\nctypes.CDLL('libc.so.6')", "ctypes.dlopen")):
        result = run(code)
        assert result.outcome == Outcome.ERROR and f"the sandbox refuses {event}" in result.stderr, code


def test_calls_run_concurrently_on_one_event_loop():
    async def both():
        return await asyncio.gather(*(run_python(f"import time\ntime.sleep(1)\nprint({i})", FAST) for i in range(2)))

    start = time.monotonic()
    results = asyncio.run(both())
    assert [r.stdout for r in results] == ["0\n", "1\n"]
    assert time.monotonic() - start < 1.9 + max(r.wall_s - 1 for r in results)  # overlapped, not one after another


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match=r"sandbox cpu_s=0 must be an integer >= 1"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match=r"sandbox wall_s=0 must be > 0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match=r"network='docker' must be 'netns' or 'audit_hook'"):
        run("print(1)", network="docker")


def _wait_gone(pids: list[int], deadline_s: float = 10.0) -> None:
    """Each pid ends (gone, or a zombie waiting for init to reap it) within the deadline."""
    end = time.monotonic() + deadline_s
    alive = list(pids)
    while alive and time.monotonic() < end:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    assert not alive, f"processes {alive} outlived the sandbox call"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_no_scratch_dir_is_left_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the call's scratch dir
    result = run("import os\nopen('x', 'w').write('y')\nprint(os.getcwd())")
    assert result.outcome == Outcome.OK and result.stdout.startswith(str(tmp_path / "topp_rl_sandbox_"))
    assert list(tmp_path.iterdir()) == []
