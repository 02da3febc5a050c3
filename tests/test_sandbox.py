"""The sandbox of task=python_tool (topp_rl/tasks/sandbox.py): each outcome and limit on real child processes, and
each way out of the boundary (files, programs, signals, sockets, what is visible, the totals) contained, checked
from outside: the files, processes and listeners the test owns are untouched. Confined calls run in the bubblewrap
that scripts/setup.sh installs (no model needed)."""

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from topp_rl.tasks.sandbox import Outcome, SandboxLimits, check_confinement, run_python

FAST = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=10.0, output_bytes=512)
PROBE = SandboxLimits(cpu_s=2, memory_mb=256, wall_s=10.0, output_bytes=8192)  # room for each try's line
MODES = [False, True]  # unconfined: the opt-in without a boundary runs the same code and outcomes
REPO = Path(__file__).resolve().parents[1]


def run(code: str, limits: SandboxLimits = FAST, *, unconfined: bool = False):
    return asyncio.run(run_python(code, limits, unconfined=unconfined))


@pytest.fixture
def outside(tmp_path):
    """A dir of the test's (as a run dir would be) holding one file: a call must leave both as they are."""
    (tmp_path / "sentinel").write_text("kept")
    yield tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sentinel"]
    assert (tmp_path / "sentinel").read_text() == "kept"


def attempts(*tries: str) -> str:
    """Code trying each statement in turn, printing `escaped: <statement>` for each that succeeds."""
    lines = ["import os, sys, socket, subprocess"]
    for statement in tries:
        lines += ["try:", f"    {statement}", f"    print('escaped:', {statement!r})", "except Exception as e:",
                  f"    print('contained:', {statement!r}, type(e).__name__, e)"]
    return "\n".join(lines)


def assert_contained(code: str, count: int) -> None:
    result = run(code, PROBE)
    assert result.outcome == Outcome.OK and result.confinement == "bwrap", result
    assert "escaped" not in result.stdout, result.stdout
    assert result.stdout.count("contained:") == count, result.stdout


# ----- outcomes and limits, confined and unconfined -----
@pytest.mark.parametrize("unconfined", MODES)
def test_code_runs_and_its_output_comes_back(unconfined):
    result = run("import math\nprint(37 + 48)\nprint(math.factorial(5))", unconfined=unconfined)
    assert (result.outcome, result.stdout, result.stderr, result.exit_code) == (Outcome.OK, "85\n120\n", "", 0)
    assert result.confinement == ("unconfined" if unconfined else "bwrap")


@pytest.mark.parametrize("unconfined", MODES)
def test_an_exception_is_an_error_with_the_codes_own_traceback(unconfined):
    result = run("x = 1\ny = x / 0", unconfined=unconfined)
    assert result.outcome == Outcome.ERROR and result.exit_code == 1
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"<tool>\", line 2, in <module>\n")
    assert result.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert "sandbox_child" not in result.stderr and "<string>" not in result.stderr  # not the runner's frames
    syntax = run("print(", unconfined=unconfined)
    assert syntax.outcome == Outcome.ERROR and "SyntaxError" in syntax.stderr
    assert run("import sys; sys.exit(3)", unconfined=unconfined).exit_code == 3


@pytest.mark.parametrize("unconfined", MODES)
def test_the_wall_timeout_stops_the_call(unconfined):
    start = time.monotonic()
    result = run("import os, time\nos.fork()\ntime.sleep(60)", SandboxLimits(cpu_s=5, wall_s=1.5),
                 unconfined=unconfined)
    assert result.outcome == Outcome.TIMEOUT and result.exit_code is None
    assert 1.5 <= time.monotonic() - start < 30  # not the sleepers' 60 s


@pytest.mark.parametrize("unconfined", MODES)
def test_a_cpu_loop_is_stopped_by_its_cpu_limit(unconfined):
    result = run("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30.0), unconfined=unconfined)
    assert result.outcome == Outcome.CPU_LIMIT and result.exit_code is None and result.wall_s < 30


@pytest.mark.parametrize("unconfined", MODES)
def test_one_big_allocation_fails_with_memory_error(unconfined):
    result = run("blob = bytearray(1024 ** 3)\nprint('allocated')", unconfined=unconfined)
    assert result.outcome == Outcome.ERROR and result.stdout == ""
    assert result.stderr.endswith("MemoryError\n")


@pytest.mark.parametrize("unconfined", MODES)
def test_too_much_output_is_cut_marked_and_stops_the_code(unconfined):
    result = run("import sys\nfor _ in range(10 ** 9):\n    sys.stdout.write('x' * 1000)", unconfined=unconfined)
    assert result.outcome == Outcome.OUTPUT_LIMIT and result.exit_code is None
    assert result.stdout == "x" * 512 + "\n[output cut at 512 bytes]"
    noisy = run("import sys\nsys.stderr.write('e' * 2000)\nprint('done')", unconfined=unconfined)
    assert noisy.outcome == Outcome.OK and noisy.stdout == "done\n"  # stderr is cut, not stopped
    assert noisy.stderr == "[output cut: its first 1488 bytes dropped]\n" + "e" * 512


def test_the_unconfined_scratch_dir_is_the_cwd_and_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the call's scratch dir
    result = run("import os\nopen('x', 'w').write('y')\nprint(os.getcwd(), os.getcwd() == os.environ['HOME'])",
                 unconfined=True)
    assert result.outcome == Outcome.OK and result.stdout.startswith(str(tmp_path / "topp_rl_sandbox_"))
    assert result.stdout.endswith(" True\n") and list(tmp_path.iterdir()) == []


def test_calls_run_concurrently_on_one_event_loop():
    """The two calls' processes overlap in time, read from their own clocks (not from a bound on the elapsed time,
    which a loaded machine can break): each prints when its 2 s sleep begins and ends."""
    code = "import time\nprint(time.time())\ntime.sleep(2)\nprint(time.time())"

    async def both():
        return await asyncio.gather(*(run_python(code, FAST) for _ in range(2)))

    spans = [[float(t) for t in r.stdout.split()] for r in asyncio.run(both())]
    assert all(len(span) == 2 for span in spans)
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # overlapped, not one after another


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match=r"sandbox cpu_s=0 must be an integer >= 1"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match=r"sandbox processes=1.5 must be an integer >= 1"):
        SandboxLimits(processes=1.5)
    with pytest.raises(ValueError, match=r"sandbox wall_s=inf must be a finite number > 0"):
        SandboxLimits(wall_s=float("inf"))


def test_without_bwrap_a_confined_call_is_refused_naming_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without bwrap on it
    with pytest.raises(ValueError, match=r"needs bubblewrap \(bwrap\), which is not on PATH: apt-get install "
                                         r"bubblewrap .*; or set unconfined=True to run tool code without any"):
        run("print(1)")
    assert check_confinement(unconfined=True) == "unconfined"
    assert run("print(1)", unconfined=True).stdout == "1\n"


# ----- the boundary: every way out, checked from outside -----
def test_the_scratch_is_a_private_tmpfs_and_the_only_writable_place():
    result = run("import os\nopen('a.txt', 'w').write('hello')\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
                 "print(open('d/b.txt').read(), os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], os.getuid())")
    assert (result.outcome, result.stdout) == (Outcome.OK, "hello /tmp /tmp /tmp 1000\n")
    assert run("print(__import__('os').listdir('.'))").stdout == "[]\n"  # a fresh one per call


@pytest.fixture
def stray():
    """A file name the test owns, for tries to create it in the machine's dirs that the sandbox shows read-only
    (/, /usr, /usr/bin, /etc) or hides (/dev/shm, /run, /var/tmp); any that got through are removed after the test.
    The tries never delete or change the machine's own files: a broken sandbox must not break the machine."""
    name = f"topp_rl_sandbox_test_{os.getpid()}"
    places = [Path(d, name) for d in ("/", "/usr", "/usr/bin", "/etc", "/dev/shm", "/dev", "/run", "/var/tmp")]
    yield name
    made = [p for p in places if os.path.lexists(p)]
    for path in made:
        path.rmdir() if path.is_dir() else path.unlink()
    assert made == []


def test_chdir_and_relative_writes_stay_inside(outside, stray):
    code = attempts(f"os.chdir({str(outside)!r})", f"os.chdir({str(outside)!r}); open('new.txt', 'w')",
                    f"os.chdir('/usr'); open('{stray}', 'w')", f"os.chdir('/'); open('{stray}', 'w')",
                    f"os.chdir('/tmp'); open('../{stray}', 'w')", f"os.chdir('/usr/bin'); os.mkdir('{stray}')")
    assert_contained(code, 6)


def test_dir_fd_calls_stay_inside(outside, stray):
    create = f"os.open('{stray}', os.O_WRONLY | os.O_CREAT, dir_fd=d)"
    code = attempts(f"d = os.open({str(outside)!r}, os.O_RDONLY); {create}",
                    f"d = os.open({str(outside)!r}, os.O_RDONLY); os.unlink('sentinel', dir_fd=d)",
                    f"d = os.open('/usr', os.O_RDONLY); {create}", f"d = os.open('/', os.O_RDONLY); {create}",
                    f"d = os.open('/etc', os.O_RDONLY); {create}",
                    f"d = os.open('/usr/bin', os.O_RDONLY); os.mkdir('{stray}', dir_fd=d)")
    assert_contained(code, 6)


def test_dev_shm_run_and_var_tmp_are_not_there_to_write(stray):
    code = attempts(f"open('/dev/shm/{stray}', 'w')", f"os.chdir('/dev/shm'); open('{stray}', 'w')",
                    f"d = os.open('/dev/shm', os.O_RDONLY); os.open('{stray}', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
                    f"open('/dev/{stray}', 'w')", f"open('/run/{stray}', 'w')", f"open('/var/tmp/{stray}', 'w')")
    assert_contained(code, 6)


def test_files_outside_are_neither_created_nor_deleted_nor_changed(outside):
    sentinel, new = str(outside / "sentinel"), str(outside / "new.txt")
    code = attempts(f"open({new!r}, 'w')", f"open({sentinel!r}, 'a')", f"os.remove({sentinel!r})",
                    f"os.rename({sentinel!r}, 'here.txt')", f"os.chmod({sentinel!r}, 0o777)",
                    f"os.symlink({sentinel!r}, {new!r})", f"os.truncate({sentinel!r}, 0)",
                    f"os.chdir({str(outside)!r}); os.remove('sentinel')",
                    f"d = os.open({str(outside)!r}, os.O_RDONLY); os.rename('sentinel', 'moved', src_dir_fd=d, "
                    "dst_dir_fd=d)", "open('/etc/ld.so.cache', 'a')")
    assert_contained(code, 10)


def test_programs_run_but_cannot_write_outside(outside):
    """Programs run (inside the same boundary): a shell started any way writes only the scratch."""
    target = outside / "shell.txt"
    write = f"echo x > {target} && test -s {target}"
    tries = [f"assert os.system({write!r}) == 0", f"subprocess.run(['/bin/sh', '-c', {write!r}], check=True)",
             f"os.posix_spawn('/bin/sh', ['sh', '-c', {write!r}], {{}}); assert os.wait()[1] == 0"]
    if sys.version_info[:2] == (3, 11):  # the C call under subprocess, with 3.11's positional arguments
        tries.append("import _posixsubprocess; r, w = os.pipe(); pid = _posixsubprocess.fork_exec("
                     f"['/bin/sh', '-c', {write!r}], (b'/bin/sh',), True, (w,), None, None, -1, -1, -1, "
                     "-1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, True); os.close(w); "
                     "os.read(r, 64); assert os.waitpid(pid, 0)[1] == 0")
    assert_contained(attempts(*tries), len(tries))
    inside = run("import subprocess\nprint(subprocess.run(['/bin/sh', '-c', 'echo in > here.txt; cat here.txt'], "
                 "capture_output=True, text=True).stdout, end='')")
    assert (inside.outcome, inside.stdout) == (Outcome.OK, "in\n")


def test_signals_reach_no_process_outside():
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its group is its own: killpg spares ours
    try:
        code = attempts(f"os.kill({sleeper.pid}, 9)", f"os.kill({os.getpid()}, 0)", f"os.kill({os.getppid()}, 0)",
                        f"os.killpg({os.getpgid(sleeper.pid)}, 9)")
        assert_contained(code, 4)
        assert sleeper.poll() is None  # still running
        ps = run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
        assert ps.stdout == "[1, 2]\n"  # bwrap's init and the interpreter: nothing else is visible
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_socket_reaches_a_listener_of_the_machine(tmp_path):
    path, abstract = str(tmp_path / "listener.sock"), f"\0topp_rl_sandbox_test_{os.getpid()}"
    servers = [socket.create_server(("127.0.0.1", 0))]
    for address in (path, abstract):
        servers.append(socket.socket(socket.AF_UNIX))
        servers[-1].bind(address)
        servers[-1].listen()
    try:
        port = servers[0].getsockname()[1]
        code = attempts(f"socket.create_connection(('127.0.0.1', {port}), timeout=3)",
                        f"socket.socket(socket.AF_UNIX).connect({path!r})",
                        f"socket.socket(socket.AF_UNIX).connect({abstract!r})",
                        "socket.getaddrinfo('example.com', 80)")
        assert_contained(code, 4)
        for server in servers:
            server.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing reached it
                server.accept()
    finally:
        for server in servers:
            server.close()


def test_the_repository_home_and_a_run_dir_are_invisible(outside):
    home = Path.home()
    python_top = Path(sys.base_prefix).resolve()
    hidden = [REPO, Path(sys.prefix), outside, outside / "sentinel", Path(f"/proc/{os.getpid()}")]
    # home's entries, except the one leading to the interpreter's install (which is mounted read-only)
    hidden += [p for p in home.iterdir() if not python_top.is_relative_to(p.resolve())]
    code = (f"import os\nhidden = {[str(p) for p in hidden]!r}\n"
            "print([p for p in hidden if os.path.lexists(p)])\n"
            "print(sorted(os.listdir('/')), sorted(os.listdir('/etc')))")
    result = run(code)
    assert result.outcome == Outcome.OK and len(hidden) >= 5
    visible, listing = result.stdout.splitlines()
    assert visible == "[]"
    links = {"bin", "sbin", "lib", "lib32", "lib64", "libx32"} & set(os.listdir("/"))
    python_tops = {Path(p).resolve().parts[1] for p in (sys.base_prefix, sys.base_exec_prefix)}
    etc = sorted(p for p in ("ld.so.cache", "localtime") if os.path.lexists(f"/etc/{p}"))
    assert listing == f"{sorted(links | python_tops | {'dev', 'etc', 'proc', 'tmp', 'usr'})} {etc}"


def test_a_fork_bomb_is_bounded_by_the_process_cap():
    code = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
            "    print(n, e.strerror)")
    result = run(code, SandboxLimits(cpu_s=5, wall_s=10, processes=8))
    assert (result.outcome, result.stdout) == (Outcome.OK, "7 Resource temporarily unavailable\n")  # 7 + itself


def test_memory_is_bounded_for_all_processes_together():
    """Four forks of 100 MB each fit the per-process bound (256 MB) but not the total: the kernel kills one, the
    parent sees it die (the others would hold theirs for a minute). How many print "held" is not bounded by 2: the
    kill frees room, so a later fork may then allocate and print before the parent sees the death (3 under load)."""
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        blob = b'x' * (100 * 2**20)\n"
            "        print('held', flush=True)\n        time.sleep(60)\n        os._exit(0)\n"
            "pid, status = os.wait()\nprint('died', os.WTERMSIG(status))")
    result = run(code, SandboxLimits(cpu_s=5, memory_mb=256, wall_s=20))
    assert result.outcome == Outcome.MEMORY_LIMIT and result.exit_code is None and result.wall_s < 20
    assert "died 9\n" in result.stdout  # SIGKILL


def test_files_are_bounded_in_total():
    code = ("n = 0\ntry:\n    while n < 64:\n        open(f'f{n}', 'wb').write(b'x' * 2**20)\n        n += 1\n"
            "except OSError as e:\n    print(n, e.strerror)")
    result = run(code, SandboxLimits(scratch_mb=8))
    n, error = result.stdout.split(" ", 1)
    assert result.outcome == Outcome.OK and int(n) <= 8 and error == "No space left on device\n"


@pytest.mark.parametrize("leave", ["fork", "setsid"])
def test_no_process_of_the_call_outlives_it(leave):
    """A background sleeper (a forked one, or one that left the session and its parent, as a daemon does), holding
    the output pipes, is gone when the call returns, at once rather than at the wall timeout, and so is the call's
    cgroup."""
    token = f"{time.time() % 1000:.6f}{os.getpid()}"  # a sleep argument no other process has
    daemon = "os.setsid()\n    if os.fork():\n        os._exit(0)\n    " if leave == "setsid" else ""
    code = (f"import os, time\nif os.fork() == 0:\n    {daemon}try:\n        os.execv('/bin/sleep', ['sleep', "
            f"'{token}'])\n    except OSError:\n        time.sleep(60)\ntime.sleep(0.2)\nprint('started')")
    result = run(code, SandboxLimits(cpu_s=2, wall_s=20))
    left = _sleepers(token)
    for pid in left:  # a broken sandbox's leftovers are the test's to end
        os.kill(pid, 9)
    assert (result.outcome, result.stdout, left) == (Outcome.OK, "started\n", [])
    assert result.wall_s < 10  # not held up by the pipes until the wall timeout (20 s)
    assert not [p for p in Path("/sys/fs/cgroup").rglob(f"topp_rl_sandbox_{os.getpid()}_*")]


def _sleepers(token: str) -> list[int]:
    """The running (not zombie) processes of the machine whose command line holds `token`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token in (entry / "cmdline").read_text() \
                    and (entry / "stat").read_text().rpartition(")")[2].split()[0] != "Z":
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found
