"""The `tool_use` environment: multi-turn tool calls, then a final answer scored by another environment.

Protocol (the Hermes/Qwen convention): in a turn the policy may emit one or more
`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` blocks. Each is run and its result comes
back as one `tool` message (the chat template renders it; the tokens are appended to the sequence
and never trained on). A turn without a tool call is the final answer, scored by the environment
named in `tool_use.answer_env` (`math` by default) against the record. The rollout
(`rollout/multi_turn.py`) stops after `rollout.max_turns` policy turns whatever the policy does.

Built-in tools:
- `calculator`: `{"expression": "23 * (4 + 5)"}`; +, -, *, /, //, %, ** (exponent at most 100) and
  parentheses over integers and decimals, evaluated on the parsed syntax tree, never `eval`.
- `python`: `{"code": "print(2 ** 10)"}`; runs in the code sandbox (`envs/sandbox.py`: no network,
  no writes outside its own directory, CPU, memory and wall-time limits) and returns its stdout, or
  the last line of its error.

A malformed call (bad JSON, an unknown tool, bad arguments) is answered with an error message as the
observation, the way a real tool would answer: the policy can learn from it. So is whatever the policy's
program does inside the sandbox (an exception, a timeout within its limits). A tool whose own machinery
fails (the sandbox crashed, was killed from outside or could not start: status `error`; an OSError out of
the tool, such as no file descriptor left) gives the policy nothing to learn from: that turn is an
infrastructure failure (`infra_failure="sandbox"`, or `"tool"` for another tool's OSError), which the
rollout runs again and then masks (rollout/infra.py), never an observation. Each turn with calls
costs nothing in reward; `tool_use.call_penalty` can charge for calls.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Callable

from reinforge.config.section import Section
from reinforge.data.tool_calls import ToolCall, parse_tool_calls
from reinforge.envs.base import Environment, EnvRequest, EnvResponse, Tool
from reinforge.envs.sandbox import SandboxLimits, run_python

MAX_OBSERVATION_CHARS = 2000


class ToolFailure(RuntimeError):
    """A tool's own machinery failed, not the call: no observation to give the policy (an env server answers 500)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class ToolUseEnvConfig(Section):
    tools: list[str] = ["calculator", "python"]
    """Tools offered to the policy (built in: calculator, python)."""
    answer_env: str = "math"
    """Environment that scores the final answer (a turn without tool calls)."""
    call_penalty: float = 0.0
    """Reward subtracted per tool call (0: calls are free)."""
    sandbox: SandboxLimits = SandboxLimits(wall_time_s=5.0, cpu_time_s=5.0, memory_mb=512)
    """Limits for the `python` tool's sandbox."""


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculate(expression: str) -> str:
    """The calculator tool: arithmetic on the syntax tree of `expression`; ValueError when it is not arithmetic."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent larger than 100")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"unsupported syntax in {expression!r}: only numbers, + - * / // % ** and parentheses")

    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


def tool_use_components(request: EnvRequest) -> dict[str, float]:
    """How the conversation used tools: `num_tool_calls` (tool results it got), and, when the record has
    an `answer`, `tool_result_correct` (1 when some tool result is exactly that answer: the tool was
    asked the right question)."""
    results = [str(m.get("content", "")).strip() for m in request.messages if m.get("role") == "tool"]
    components = {"num_tool_calls": float(len(results))}
    if "answer" in request.record:
        components["tool_result_correct"] = float(str(request.record["answer"]).strip() in results)
    return components


class ToolUseEnv:
    """Runs tool calls until the policy answers; the answer goes to `answer_env`."""

    def __init__(self, config: ToolUseEnvConfig, answer_env: Environment):
        self.config, self.answer_env = config, answer_env
        builtins = {
            "calculator": Tool(
                "calculator",
                "Evaluate an arithmetic expression exactly.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                lambda arguments: calculate(str(arguments["expression"])),
            ),
            "python": Tool(
                "python",
                "Run a Python program in a sandbox and return what it prints.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                self._run_python,
            ),
        }
        unknown = [name for name in config.tools if name not in builtins]
        if unknown:
            from reinforge.errors import ConfigError

            raise ConfigError(f"env.tool_use.tools: unknown tool {unknown[0]!r}; built-in tools: {', '.join(builtins)}")
        self.tools = {name: builtins[name] for name in config.tools}
        self.counts = dict.fromkeys(["tool_calls", "tool_errors", "tool_failures", "final_answers"], 0)

    def _run_python(self, arguments: dict[str, Any]) -> str:
        try:
            result = run_python(str(arguments["code"]), self.config.sandbox)
        except OSError as exc:  # no process, pipe or file descriptor left for the sandbox
            raise ToolFailure(f"the python tool's sandbox could not start: {exc!r}", "sandbox") from exc
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        if result.status == "error":  # the sandbox's own failure, not the program's
            raise ToolFailure(f"the python tool's sandbox failed: {lines[-1] if lines else 'no output'}", "sandbox")
        if result.status == "ok":
            return result.stdout
        return f"error ({result.status}): {lines[-1] if lines else 'no output'}"

    def run_call(self, call: ToolCall | str) -> str:
        """The observation for one parsed call."""
        self.counts["tool_calls"] += 1
        if isinstance(call, str):
            self.counts["tool_errors"] += 1
            return call
        tool = self.tools.get(call.name)
        if tool is None:
            self.counts["tool_errors"] += 1
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}"
        try:
            return tool.run(call.arguments)[:MAX_OBSERVATION_CHARS]
        except (ValueError, KeyError, TypeError) as exc:  # called wrongly: the policy's, and it can learn from it
            self.counts["tool_errors"] += 1
            return f"error: {exc}"
        except OSError as exc:
            raise ToolFailure(f"tool {call.name!r} failed: {exc!r}", "tool") from exc

    def step(self, requests: list[EnvRequest]) -> list[EnvResponse]:
        responses: list[EnvResponse | None] = [None] * len(requests)
        final = []
        for index, request in enumerate(requests):
            calls = parse_tool_calls(request.messages[-1]["content"])
            if not calls:
                final.append(index)
                continue
            try:
                observations = [{"role": "tool", "content": self.run_call(call)} for call in calls]
            except ToolFailure as exc:  # no verdict and no observation: the rollout runs the episode again
                self.counts["tool_failures"] += 1
                responses[index] = EnvResponse(reward=0.0, infra_failure=exc.kind, info={"infra_error": str(exc)})
                continue
            penalty = -self.config.call_penalty * len(calls)
            responses[index] = EnvResponse(
                reward=penalty, components={"tool_calls": penalty}, done=False, observation=observations
            )
        if final:
            self.counts["final_answers"] += len(final)
            for index, response in zip(final, self.answer_env.step([requests[i] for i in final])):
                response.components.update(tool_use_components(requests[index]))
                responses[index] = response
        return responses  # type: ignore[return-value]

    def metrics(self) -> dict[str, float]:
        counts = {name: float(value) for name, value in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        return counts | {f"answer/{name}": value for name, value in self.answer_env.metrics().items()}

    def close(self) -> None:
        self.answer_env.close()
