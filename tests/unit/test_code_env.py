"""The code environment on HumanEval and MBPP, with real sandbox runs.

Every reference solution must pass, written as a model would (a ```python block after some prose),
and mutated solutions must fail. To stay inside the time budget every other record is mutated,
once, by one of three mutations in turn (record 2j gets mutation j mod 3):

- wrong_constant: the tested function is redefined to return -987654321;
- drop_last_line: the program loses its last line;
- off_by_one: the tested function's result gets + 1 (a TypeError for non-numbers, which fails too).

Known equivalent mutants, where the tests cannot tell the mutant from the reference, are listed
in MUTANT_EXCEPTIONS with the reason.
"""

import ast
import json
import os
import secrets
import select
import socket
import time
from pathlib import Path

import pytest

from reinforge.envs.base import EnvRequest
from reinforge.envs.code_env import CodeEnv, CodeEnvConfig, extract_code
from reinforge.envs.sandbox import SandboxLimits
from reinforge.errors import DataError

# One xdist worker runs every test that starts sandboxes in turn: some count the live sandbox processes
# (see tests/conftest.py).
pytestmark = [
    pytest.mark.xdist_group("sandbox"),
    pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning"),  # in MBPP code
]
BENCHMARKS = Path(__file__).resolve().parents[2] / "data" / "benchmarks"
HUMANEVAL = [json.loads(line) for line in (BENCHMARKS / "humaneval" / "HumanEval.jsonl").read_text().splitlines()]
MBPP = json.loads((BENCHMARKS / "mbpp" / "sanitized-mbpp.json").read_text())
MUTANT_EXCEPTIONS = {
    # MBPP 82 and 85 compare with math.isclose(rel_tol=0.001) on values in the thousands: + 1 is inside it.
    ("mbpp", 82, "off_by_one"),
    ("mbpp", 85, "off_by_one"),
    # The dropped last line is `return False` / `return None` (the implicit None passes `assert not ...`
    # or `== None`), or unreachable.
    *(("mbpp", task_id, "drop_last_line") for task_id in (9, 20, 160, 223, 395, 627, 803, 804)),
}
# MBPP 123 (amicable numbers below 9999) takes ~3 s of CPU on its own; leave room for a loaded machine.
REFERENCE_LIMITS = SandboxLimits(wall_time_s=60.0, cpu_time_s=60.0)


def request(response: str, record: dict) -> EnvRequest:
    return EnvRequest(
        messages=[{"role": "user", "content": "Write it."}, {"role": "assistant", "content": response}], record=record
    )


def as_model_answer(program: str) -> str:
    return f"Here is my solution.\n\n```python\n{program}\n```\n\nIt runs in linear time."


@pytest.fixture(scope="module")
def env():
    env = CodeEnv(CodeEnvConfig(num_parallel=8, sandbox=REFERENCE_LIMITS))
    yield env
    env.close()


def mbpp_function(record: dict) -> str:
    """The function the first assert calls, among those the reference defines."""
    defined = {node.name for node in ast.parse(record["code"]).body if isinstance(node, ast.FunctionDef)}
    calls = [
        node.func.id
        for node in ast.walk(ast.parse(record["test_list"][0]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    return next(name for name in calls if name in defined)


def mutate(program: str, function: str, mutation: str) -> str:
    if mutation == "wrong_constant":
        return f"{program}\n\ndef {function}(*args, **kwargs):\n    return -987654321\n"
    if mutation == "drop_last_line":
        return "\n".join(program.rstrip().splitlines()[:-1]) + "\n"
    assert mutation == "off_by_one"
    return (
        f"{program}\n\n_reference = {function}\n\n"
        f"def {function}(*args, **kwargs):\n    return _reference(*args, **kwargs) + 1\n"
    )


MUTATIONS = ["wrong_constant", "drop_last_line", "off_by_one"]


# --- extraction ---------------------------------------------------------------------------------


def test_the_last_python_block_wins_over_other_blocks():
    text = "```python\nx = 1\n```\nthen\n```bash\nls\n```\nfinally\n```py\nx = 2\n```\n```text\nout\n```"
    assert extract_code(text) == "x = 2\n"


def test_without_a_python_block_the_last_fenced_block_is_taken_else_the_whole_text():
    assert extract_code("```\na = 1\n```\n```\nb = 2\n```") == "b = 2\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_a_block_left_open_by_the_length_limit_runs_to_the_end():
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n") == "def f():\n    return 1\n"


# --- references and mutants ---------------------------------------------------------------------


def test_every_humaneval_reference_solution_passes(env):
    programs = [record["prompt"] + record["canonical_solution"] for record in HUMANEVAL]
    responses = env.step([request(as_model_answer(p), r) for p, r in zip(programs, HUMANEVAL)])
    failed = {r["task_id"]: resp.info for r, resp in zip(HUMANEVAL, responses) if resp.reward != 1.0}
    assert failed == {}
    assert all(resp.info["passed"] == resp.info["total"] > 0 for resp in responses)


def test_humaneval_bodies_without_the_signature_complete_the_prompt(env):
    """A completion model answers with the indented body only; the prompt supplies the rest."""
    records = HUMANEVAL[::8]
    responses = env.step([request(as_model_answer(r["canonical_solution"]), r) for r in records])
    assert [resp.reward for resp in responses] == [1.0] * len(records)


def test_every_mbpp_reference_solution_passes(env):
    responses = env.step([request(as_model_answer(r["code"]), r) for r in MBPP])
    failed = {r["task_id"]: resp.info for r, resp in zip(MBPP, responses) if resp.reward != 1.0}
    assert failed == {}


def test_mutated_solutions_score_zero():
    cases = []  # (dataset, task_id, mutation, request)
    for i, record in enumerate(HUMANEVAL[::2]):
        mutation = MUTATIONS[i % 3]
        program = mutate(record["prompt"] + record["canonical_solution"], record["entry_point"], mutation)
        cases.append(("humaneval", record["task_id"], mutation, request(as_model_answer(program), record)))
    for i, record in enumerate(MBPP[::2]):
        mutation = MUTATIONS[i % 3]
        program = mutate(record["code"], mbpp_function(record), mutation)
        cases.append(("mbpp", record["task_id"], mutation, request(as_model_answer(program), record)))
    with CodeEnv(CodeEnvConfig(num_parallel=8, sandbox=SandboxLimits(wall_time_s=10.0))) as env:  # a mutant may loop
        responses = env.step([case[3] for case in cases])
    survivors = {case[:3] for case, response in zip(cases, responses) if response.reward != 0.0}
    tested = {case[:3] for case in cases}
    assert survivors == MUTANT_EXCEPTIONS & tested
    assert len(tested) == 82 + 214  # 2 of them known equivalents


# --- partial credit and result parsing ------------------------------------------------------------

DOUBLING = {
    "task_id": "doubling",
    "tests": ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7", "assert f(4) == 8"],
}


def test_partial_credit_is_the_fraction_of_asserts_that_pass():
    """f(x) = 2x passes f(1)==2, f(2)==4 and f(4)==8 but not f(3)==7: 3 of 4 = 0.75."""
    program = as_model_answer("def f(x):\n    return 2 * x")
    with CodeEnv(CodeEnvConfig(partial_credit=True)) as partial, CodeEnv(CodeEnvConfig()) as binary:
        assert partial.step([request(program, DOUBLING)])[0].reward == 0.75
        response = binary.step([request(program, DOUBLING)])[0]
    assert response.reward == 0.0
    assert response.components == {"pass_fraction": 0.75}
    assert (response.info["passed"], response.info["total"]) == (3, 4)
    assert response.info["error"].startswith("AssertionError")


def test_partial_credit_on_humaneval_counts_the_asserts_of_check():
    """check has a setup line and 3 asserts using candidate; `return x` passes the 1st and 3rd: 2/3."""
    record = {
        "task_id": "identity",
        "prompt": "def ident(x):\n    '''Return x.'''\n",
        "entry_point": "ident",
        "test": "def check(candidate):\n    y = 5\n    assert candidate(1) == 1\n    assert candidate(y) == 6\n"
        "    for i in range(3):\n        assert candidate(i) == i\n",
    }
    with CodeEnv(CodeEnvConfig(partial_credit=True)) as env:
        response = env.step([request(as_model_answer("def ident(x):\n    return x"), record)])[0]
    assert response.reward == pytest.approx(2 / 3)
    assert (response.info["passed"], response.info["total"]) == (2, 3)


def test_tests_that_ran_before_a_timeout_still_count():
    """f loops forever on 3: f(1) and f(2) pass, f(3) and f(4) never report: 2 of 4 = 0.5."""
    program = as_model_answer("def f(x):\n    while x == 3:\n        pass\n    return 2 * x")
    config = CodeEnvConfig(partial_credit=True, sandbox=SandboxLimits(wall_time_s=2.0))
    with CodeEnv(config) as env:
        response = env.step([request(program, DOUBLING)])[0]
        metrics = env.metrics()
    assert response.reward == 0.5 and response.info["status"] == "timeout"
    assert metrics["timeouts"] == 1.0 and metrics["pass_fraction_mean"] == 0.5


def test_a_program_that_passes_and_then_hangs_gets_partial_credit_but_no_binary_reward():
    """A non-daemon thread keeps the interpreter from exiting after all 4 tests passed."""
    program = as_model_answer(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\ndef f(x):\n    return 2 * x"
    )
    record = {"task_id": "doubling", "tests": ["assert f(1) == 2", "assert f(2) == 4"]}
    sandbox = SandboxLimits(wall_time_s=1.0)
    with (
        CodeEnv(CodeEnvConfig(sandbox=sandbox)) as binary,
        CodeEnv(CodeEnvConfig(sandbox=sandbox, partial_credit=True)) as partial,
    ):
        responses = [env.step([request(program, record)])[0] for env in (binary, partial)]
    assert [(r.reward, r.info["status"], r.info["passed"]) for r in responses] == [
        (0.0, "timeout", 2),
        (1.0, "timeout", 2),
    ]


def test_printed_junk_and_fake_result_lines_do_not_change_the_score():
    program = as_model_answer(
        "import sys\n"
        'print(\'{"step": 5, "ok": true, "error": ""}\')\n'
        "sys.stdout.write('no newline at the end' * 100)\n"
        "sys.stderr.write('noise')\n"
        "def f(x):\n    print('called', x, end='')\n    return 2 * x"
    )
    with CodeEnv(CodeEnvConfig(partial_credit=True)) as env:
        assert env.step([request(program, DOUBLING)])[0].reward == 0.75


def test_a_program_that_exits_early_or_reads_stdin_passes_nothing():
    programs = ["import os\nos._exit(0)", "input()\ndef f(x):\n    return 2 * x", "raise SystemExit(0)"]
    with CodeEnv(CodeEnvConfig(partial_credit=True)) as env:
        assert [r.reward for r in env.step([request(as_model_answer(p), DOUBLING) for p in programs])] == [0.0] * 3


def test_mbpp_test_imports_and_setup_code_run_around_the_program():
    record = {
        "task_id": 1,
        "test_imports": ["import math"],
        "test_setup_code": "VALUE = math.pi",
        "test_list": ["assert math.isclose(area(1), VALUE)"],
    }
    with CodeEnv(CodeEnvConfig()) as env:
        assert (
            env.step([request(as_model_answer("import math\ndef area(r):\n    return math.pi * r * r"), record)])[
                0
            ].reward
            == 1.0
        )


def test_a_response_without_code_scores_zero_without_a_run_and_is_counted():
    with CodeEnv(CodeEnvConfig()) as env:
        response = env.step([request("```python\n\n```", DOUBLING)])[0]
        assert (response.reward, response.info["status"]) == (0.0, "no_code")
        assert env.metrics()["no_code"] == 1.0
        assert env.metrics()["no_code"] == 0.0  # counters reset on each call


def test_a_record_without_tests_is_a_data_error_before_any_run():
    with CodeEnv(CodeEnvConfig()) as env, pytest.raises(DataError, match="CodeEnv needs tests"):
        env.step([request("x = 1", DOUBLING), request("x = 1", {"question": "?"})])
    with pytest.raises(ValueError, match="num_parallel must be >= 1"):
        CodeEnvConfig(num_parallel=0)


# --- hostile programs ---------------------------------------------------------------------------


def test_hostile_programs_are_contained_and_score_zero(tmp_path, monkeypatch):
    """Each program defines a correct `add` only after its attack, so it scores 1 only if the attack
    raised nothing; every one must score 0 within the time limit, and the host must be untouched."""
    marker = f"0.{secrets.randbelow(10**12):012d}"  # `sleep 600 <marker>` processes mark leftovers
    secret = "s3cret-" + secrets.token_hex(8)
    monkeypatch.setenv("REINFORGE_TEST_SECRET", secret)
    files = [f"/tmp/{marker}", f"{os.getcwd()}/{marker}", f"{tmp_path}/{marker}"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    attacks = {
        "infinite_loop": "while True:\n    pass",
        "fork_bomb": f"import os\nwhile True:\n    try:\n        if os.fork() == 0 and os.getpid() % 4 == 0:\n"
        f"            os.execv('/bin/sleep', ['sleep', '600', '{marker}'])\n    except OSError:\n        pass",
        "thread_bomb": (
            "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(600,)).start()"
        ),
        "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(100 << 20))",
        "output_flood": "import sys\nwhile True:\n    sys.stdout.write('spam' * 10000)",
        "daemon": f"import os\nif os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['sleep', '600', '{marker}'])\n"
        "raise RuntimeError('a daemon alone does not pass')",
        **{f"write_{i}": f"open({path!r}, 'w').write('x')" for i, path in enumerate(files)},
        # /dev/shm is the program's own (a private tmpfs): the write succeeds, and must not reach the host's
        "write_shm": f"open('/dev/shm/{marker}', 'w').write('x')\nraise RuntimeError('it wrote')",
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "kill_test_process": f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
        "kill_everything": "import subprocess\nsubprocess.run('kill -9 -1', shell=True)",
        "read_environment": "import glob, os\nseen = str(dict(os.environ))\n"
        f"for path in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ']:\n"
        "    try:\n        seen += open(path, 'rb').read().decode('latin-1')\n    except OSError:\n        pass\n"
        f"assert {secret!r} in seen",
    }
    add = "\ndef add(a, b):\n    return a + b\n"
    record = {"task_id": "add", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    config = CodeEnvConfig(
        num_parallel=len(attacks),
        partial_credit=True,
        sandbox=SandboxLimits(wall_time_s=3.0, cpu_time_s=3.0, memory_mb=512, max_processes=32),
    )
    sandbox_processes_before = _live_processes_of_sandbox_uids()
    start = time.monotonic()
    with CodeEnv(config) as env:
        assert env.step([request(as_model_answer(add), record)])[0].reward == 1.0  # the test itself is passable
        responses = env.step([request(as_model_answer(attack + add), record) for attack in attacks.values()])
        metrics = env.metrics()
    elapsed = time.monotonic() - start
    try:
        assert {name: r.reward for name, r in zip(attacks, responses)} == dict.fromkeys(attacks, 0.0)
        assert elapsed < 30.0
        assert metrics["timeouts"] >= 3 and metrics["output_limits"] == 1 and metrics["sandbox_errors"] == 0
        assert secret not in repr(responses)
        assert not any(Path(path).exists() for path in [*files, f"/dev/shm/{marker}"])
        assert select.select([listener], [], [], 0.2)[0] == []  # nobody connected
        assert [pid for pid in _pids() if marker.encode() in _read(f"/proc/{pid}/cmdline") and _alive(pid)] == []
        deadline = time.monotonic() + 15  # SIGKILLed bombs may take a moment to go on a loaded machine
        while (left := _live_processes_of_sandbox_uids() - sandbox_processes_before) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == set()
    finally:
        listener.close()


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:  # the process is gone
        return b""


def _alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def _live_processes_of_sandbox_uids() -> set[int]:
    """Every sandbox runs as a uid of 2^30 or more, which nothing else uses."""
    found = set()
    for pid in _pids():
        uid_line = [line for line in _read(f"/proc/{pid}/status").splitlines() if line.startswith(b"Uid:")]
        if uid_line and int(uid_line[0].split()[1]) >= 1 << 30 and _alive(pid):
            found.add(pid)
    return found
