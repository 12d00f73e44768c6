"""The sandbox: real processes, real namespaces; each hostile program is checked from the host.

Leftover processes are found two ways: by a marker (hostile programs exec `sleep 600 <marker>`;
GNU sleep adds up its arguments, so a unique small number is a harmless marker), and by uid
(every sandbox runs as a uid of 2^30 or more that no other process has).
"""

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reinforge.envs.sandbox import SandboxLimits, run_python

# One xdist worker runs every test that starts sandboxes in turn: some count the live sandbox processes
# (see tests/conftest.py).
pytestmark = pytest.mark.xdist_group("sandbox")

ISOLATIONS = ["namespaces", "plain"]
EVERY = ["namespaces", "user_namespaces", "plain"]  # for the protections: user_namespaces is a non-root trainer's
FAST = dict(wall_time_s=3.0, cpu_time_s=3.0, memory_mb=512, max_output_bytes=10_000)


def limits(isolation: str = "namespaces", **overrides) -> SandboxLimits:
    return SandboxLimits(isolation=isolation, **{**FAST, **overrides})


def new_marker() -> str:
    return f"0.{secrets.randbelow(10**12):012d}"


def live_processes(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def sandbox_uid_processes() -> set[int]:
    """Live processes running as a sandbox uid (2^30 and up)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{entry}/status").read_text().splitlines() if ":" in line
            )
        except OSError:
            continue
        if int(status["Uid"].split()[0]) >= 1 << 30 and status["State"].split()[0] not in ("Z", "X"):
            found.add(int(entry))
    return found


def gone_within(leftovers, seconds: float) -> set[int]:
    """`leftovers()` once it is empty, or as it is after `seconds` (the kernel reaps killed processes
    asynchronously; under load that takes a moment)."""
    deadline = time.monotonic() + seconds
    while (found := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_program_gets_its_stdin_and_returns_output_and_exit_status():
    result = run_python(
        "import sys\nprint(sys.stdin.read().upper())\nprint('oops', file=sys.stderr)", limits(), stdin="abc"
    )
    assert (result.status, result.returncode, result.stdout, result.stderr) == ("ok", 0, "ABC\n", "oops\n")
    failed = run_python("raise SystemExit(3)", limits())
    assert (failed.status, failed.returncode) == ("failed", 3)
    crashed = run_python("1 / 0", limits())
    assert crashed.status == "failed" and "ZeroDivisionError" in crashed.stderr


@pytest.mark.parametrize("isolation", EVERY)
def test_each_run_has_a_fresh_private_working_directory_that_is_deleted(isolation):
    before = set(Path("/tmp").glob("reinforge-sandbox-*"))
    program = "import os\nprint(sorted(os.listdir('.')), os.getuid())\nopen('state.txt', 'w').write('x')"
    first, second = (run_python(program, limits(isolation)) for _ in range(2))
    assert first.stdout.split()[0] == second.stdout.split()[0] == "['main.py']"  # no state.txt from the first run
    first_uid, second_uid = int(first.stdout.split()[1]), int(second.stdout.split()[1])
    assert first_uid >= 1 << 30 and second_uid >= 1 << 30 and first_uid != second_uid
    assert set(Path("/tmp").glob("reinforge-sandbox-*")) == before


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_an_infinite_loop_is_stopped_at_the_wall_time_limit(isolation):
    start = time.monotonic()
    result = run_python("import time\nwhile True:\n    time.sleep(0.01)", limits(isolation, wall_time_s=1.0))
    assert (result.status, result.returncode) == ("timeout", None)
    assert 1.0 <= time.monotonic() - start < 6.0


def test_a_busy_loop_is_stopped_at_the_cpu_time_limit():
    result = run_python("while True:\n    pass", limits(cpu_time_s=1.0, wall_time_s=30.0))
    assert (result.status, result.returncode) == ("timeout", -signal.SIGXCPU)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_memory_bomb_gets_a_memory_error(isolation):
    result = run_python(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))", limits(isolation, memory_mb=256)
    )
    assert result.status == "failed" and "MemoryError" in result.stderr


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_an_output_flood_is_cut_off_at_the_limit(isolation):
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.write(1, b'x' * 65536)", limits(isolation, wall_time_s=30.0))
    assert result.status == "output_limit" and result.stdout == "x" * 10_000
    assert time.monotonic() - start < 10.0


@pytest.mark.parametrize("isolation", EVERY)
def test_a_fork_bomb_is_contained_and_leaves_no_process(isolation):
    marker = new_marker()
    before = sandbox_uid_processes()
    program = f"""
import os
while True:
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0 and os.getpid() % 3 == 0:
        os.execv("/bin/sleep", ["sleep", "600", "{marker}"])
"""
    start = time.monotonic()
    result = run_python(program, limits(isolation, max_processes=16, wall_time_s=2.0))
    assert result.status == "timeout" and time.monotonic() - start < 10.0
    assert live_processes(marker) == []
    assert gone_within(lambda: sandbox_uid_processes() - before, 5.0) == set()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_daemon_that_escapes_the_process_group_dies_with_the_run(isolation):
    marker = new_marker()
    program = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "600", "{marker}"])
    os._exit(0)
os.wait()
print("parent done")
"""
    result = run_python(program, limits(isolation))
    assert (result.status, result.stdout) == ("ok", "parent done\n")
    assert live_processes(marker) == []


@pytest.mark.parametrize("isolation", EVERY)
def test_a_program_cannot_kill_the_caller_or_anyone_else(isolation):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        program = f"""
import os, signal, subprocess
for target in (os.getppid(), 1, {os.getpid()}, {bystander.pid}):
    try:
        os.kill(target, signal.SIGKILL)
        print("killed", target, flush=True)
    except OSError as exc:
        print("refused", target, type(exc).__name__, flush=True)
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
subprocess.run(["kill", "-9", "-1"])
"""
        result = run_python(program, limits(isolation))
        if isolation == "user_namespaces":  # its parent is pid 1, init of its namespace and of its uid: the
            # kernel drops a signal from inside that init has no handler for, so kill() succeeds to no effect
            assert result.stdout.startswith("killed 1\nkilled 1\n") and result.stdout.count("refused") == 2
        else:
            assert "killed" not in result.stdout and result.stdout.count("refused") == 4
        assert result.status == "killed"  # `kill -9 -1` reached the one process it could: the program
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_the_callers_environment_is_out_of_reach(isolation, monkeypatch):
    secret = "s3cret-" + secrets.token_hex(8)
    monkeypatch.setenv("REINFORGE_TEST_SECRET", secret)
    program = f"""
import glob, os
print(dict(os.environ))
for path in glob.glob("/proc/*/environ") + ["/proc/{os.getpid()}/environ", "/proc/1/environ"]:
    try:
        print(path, open(path, "rb").read())
    except OSError as exc:
        print(path, type(exc).__name__)
"""
    result = run_python(program, limits(isolation))
    assert result.status == "ok" and "HOME" in result.stdout
    assert secret not in result.stdout + result.stderr


@pytest.mark.parametrize("isolation", ["namespaces", "user_namespaces"])
def test_a_program_can_write_only_its_working_directory(tmp_path, isolation):
    """And its private /tmp and /dev/shm (tests/unit/test_sandbox_hostile.py); nothing reaches the host."""
    marker = new_marker()
    targets = [f"/tmp/{marker}", f"/run/{marker}", f"{os.getcwd()}/{marker}", f"{tmp_path}/{marker}", f"/{marker}"]
    program = f"""
import os
for path in {targets!r}:
    try:
        with open(path, "w") as file:
            file.write("x")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, type(exc).__name__)
open("mine.txt", "w").write("x" * 1000)
print("own directory ok")
"""
    result = run_python(program, limits(isolation))
    # user_namespaces: the namespace's one uid owns its private /tmp, which vanishes with it
    private = [f"/tmp/{marker}"] if isolation == "user_namespaces" else []
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("wrote")] == private
    assert result.stdout.count("refused") == len(targets) - len(private)
    assert "own directory ok" in result.stdout
    assert not any(Path(path).exists() for path in targets)


def test_plain_isolation_still_keeps_the_caller_directories_read_only(tmp_path):
    """Plain mode's uid owns nothing but its directory; world-writable /tmp is its documented gap."""
    marker = new_marker()
    targets = [f"{os.getcwd()}/{marker}", f"{tmp_path}/{marker}"]
    program = (
        f"for path in {targets!r}:\n    try:\n        open(path, 'w')\n        print('wrote')\n"
        "    except OSError:\n        pass"
    )
    result = run_python(program, limits("plain"))
    assert result.status == "ok" and "wrote" not in result.stdout
    assert not any(Path(path).exists() for path in targets)


def test_many_threads_share_the_sandbox_safely():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * 2)", limits()), range(16)))
    assert [result.stdout for result in results] == [f"{i * 2}\n" for i in range(16)]


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="sandbox wall_time_s must be > 0"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="isolation"):
        SandboxLimits(isolation="docker")


@pytest.mark.parametrize("isolation", EVERY)
def test_a_caller_killed_mid_run_leaves_no_process_or_directory_behind(isolation):
    workdirs = set(Path("/tmp").glob("reinforge-sandbox-*"))
    marker = new_marker()
    program = f"import os\nos.execv('/bin/sleep', ['sleep', '600', '{marker}'])"
    caller = subprocess.Popen(
        [  # the program comes on stdin: a marker in its command line would match it
            sys.executable,
            "-c",
            "import sys\nfrom reinforge.envs.sandbox import SandboxLimits, run_python\n"
            f"run_python(sys.stdin.read(), SandboxLimits(isolation={isolation!r}, wall_time_s=600))",
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
    caller.stdin.write(program)
    caller.stdin.close()
    try:
        deadline = time.monotonic() + 30
        while not live_processes(marker):
            assert time.monotonic() < deadline and caller.poll() is None
            time.sleep(0.05)
        # this run's host directory (plain mode; others may come and go meanwhile: tests on the other worker)
        ours = set(Path("/tmp").glob("reinforge-sandbox-*")) - workdirs
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 30  # generous: the suite runs two workers on two cores
    while live_processes(marker):
        assert time.monotonic() < deadline, "the sandbox outlived its caller"
        time.sleep(0.05)
    while any(path.exists() for path in ours):
        assert time.monotonic() < deadline, "the working directory outlived the caller"
        time.sleep(0.05)
