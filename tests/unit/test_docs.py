"""The documentation stays true by construction: every config key, repository path, `reinforge` command and flag
that README.md and docs/*.md cite must exist.

- Config keys: a dotted name in a code span or a command line (`loop.max_steps`, `model.lora.rank=16`), or a key
  of a fenced YAML block (`rollout:` / `  num_prompts_per_step: 32`), whose first part is a section of some recipe
  must be a key of some recipe's tree (`RECIPES`, `all_keys`), an old key a root still maps to its new place
  (`moved_keys`), or lie under a mapping field (`env.gym.<task>.url`).
  A table column headed by another project (NeMo-RL, veRL, TRL) or "old key" is not ours and is not checked.
- Paths: `configs/...`, `reinforge/...`, `bench/...`, `scripts/...`, `docs/...`, `tests/...`, `data/...`,
  `models/...` with a file suffix or a trailing `/` must exist (a `*` is a glob that must match), and so must every
  relative Markdown link's target and its `#anchor` (GitHub's slug of a heading).
- Commands: `reinforge CMD [SUB] --flag` in a code span or a fenced block must name a subcommand of
  `reinforge.cli.build_parser()` and flags that subcommand takes; `python bench/x.py --flag` a flag the script
  defines; `make TARGET` a target of the Makefile.
- docs/configuration.md's tables of each recipe's sections and of where each section is defined, and README's
  list of `reinforge grpo`'s sections, are the code's; docs/README.md lists every page.

Each check is a function from a page's text to its violations, so the tests below also plant one violation of each
kind and check that it is reported.
"""

from __future__ import annotations

import argparse
import re
import typing
from functools import cache
from pathlib import Path

import yaml
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Cited on purpose though they do not exist, each with why.
ALLOWED_KEYS = {
    "grpo.num_generatoins": "README: a typo, shown with the error it gives",
    "grpo.max_stepz": "docs/recipes.md: a typo, shown with the error it gives",
    "training.lr": "docs/configuration.md: a key of another section, shown with the error it gives",
    "grpo.advantage": "docs/algorithms.md: the key PPO is not (why PPO is a command of its own)",
}
ALLOWED_PATHS = {
    "docs/guides/grpo-deepscaler.md": "docs/recipes.md: NeMo-RL's page, in its repository",
}
# A table column headed by another project's name (or "old key") holds that project's keys, not ours.
FOREIGN_COLUMN = re.compile(r"^(NeMo-RL|veRL|TRL|old key)$")

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
DOTTED = re.compile(r"(?<![\w./<$-])([a-z_][a-z0-9_]*(?:\.(?:[a-z0-9_]+\*?|<[a-z_]+>|\*))+)")
FILE_SUFFIX = re.compile(r"\.(py|ya?ml|jsonl?|md|txt|sh|safetensors|parquet|arrow|png|toml|cfg|csv|bin|pt|html)$")
PATH = re.compile(r"(?<![\w./-])((?:configs|reinforge|bench|scripts|docs|tests|data|models)/[\w.*/-]*[\w*/])")
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
SCRIPT = re.compile(r"python3? ((?:bench|scripts)/\w+\.py)((?: [^|;&#`]*)?)")
COMMAND = re.compile(r"(?:^|(?<=[\s(/]))reinforge ([a-z][a-z-]*)((?: [^|;&#`]*)?)")


# --- what exists ---------------------------------------------------------------------------------------------------


@cache
def config_keys() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(every key of every recipe's tree and every old key still mapped, the mapping fields, the top sections)."""
    from reinforge.config.loader import all_keys, moved_keys
    from reinforge.loops.registry import RECIPES

    keys, open_keys, tops = set(), set(), set()
    for recipe in RECIPES.values():
        root = recipe.config_class
        keys.update(all_keys(root))
        keys.update(moved_keys(root))  # the root's and each section's own
        tops.update(root.model_fields)
        _walk(root, "", keys, open_keys)
    return frozenset(keys), frozenset(open_keys), frozenset(tops)


def _walk(model: type[BaseModel], prefix: str, keys: set[str], open_keys: set[str]) -> None:
    """all_keys, also through optional sections (`model.lora: LoraConfig | None`), noting the mapping fields."""
    for name, field in model.model_fields.items():
        dotted = prefix + name
        keys.add(dotted)
        for arg in (field.annotation, *typing.get_args(field.annotation)):
            if typing.get_origin(arg) is dict or arg is dict:
                open_keys.add(dotted)
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                _walk(arg, dotted + ".", keys, open_keys)


@cache
def python_attributes(module: str) -> frozenset[str]:
    """The top-level names of every reinforge module called `module` (`grpo.train_on_batch` cites a function)."""
    names = set()
    for path in (REPO / "reinforge").rglob(f"{module}.py"):
        names.update(re.findall(r"^(?:def|class) (\w+)|^(\w+)\s*[:=]", path.read_text(), re.M))
    return frozenset(n for pair in names for n in pair if n)


@cache
def commands() -> dict[str, set[str]]:
    """'grpo' -> its flags; 'env serve' -> its flags; and each group ('env') -> its subcommands' names."""
    from reinforge.cli import build_parser

    table: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        flags = {s for action in parser._actions for s in action.option_strings}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    flags.add(f"<sub>{name}")
                    walk(sub, f"{path} {name}".strip())
        table[path] = flags

    walk(build_parser(), "")
    return table


# --- the checks: a page's text -> its violations -------------------------------------------------------------------


def cited_code(text: str) -> list[str]:
    """The code a page cites: each inline code span (outside foreign table columns), each line of each fenced
    block."""
    fenced = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = mask_foreign_columns(FENCE.sub("", text))
    return CODE_SPAN.findall(prose) + fenced


def mask_foreign_columns(text: str) -> str:
    lines, foreign = text.splitlines(), set()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            foreign = set()
            continue
        cells = line.split("|")
        if i + 1 < len(lines) and lines[i + 1].startswith(("|-", "|:")):
            foreign = {j for j, cell in enumerate(cells) if FOREIGN_COLUMN.match(cell.strip())}
        lines[i] = "|".join("" if j in foreign else cell for j, cell in enumerate(cells))
    return "\n".join(lines)


def key_violations(text: str) -> list[str]:
    cited = [key for code in cited_code(text) if not _an_error(code) for key in DOTTED.findall(code)]
    return [f"config key {key}" for key in cited + yaml_keys(text) if not key_exists(key)]


def _an_error(code: str) -> bool:
    return code.lstrip().startswith(("reinforge: error", "Error", "#")) or "error:" in code


def yaml_keys(text: str) -> list[str]:
    """The dotted keys of each fenced YAML block (`rollout:` then `  num_prompts_per_step: 32` is
    rollout.num_prompts_per_step); a block that is not valid YAML, or not a mapping, holds none."""
    keys = []
    for block in re.findall(r"^```ya?ml$(.*?)^```", text, re.S | re.M):
        try:
            tree = yaml.safe_load(block)
        except yaml.YAMLError:
            continue
        if isinstance(tree, dict):
            keys.extend(_flatten(tree, ""))
    return keys


def _flatten(tree: dict, prefix: str) -> list[str]:
    keys = []
    for name, value in tree.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        if isinstance(value, dict):
            keys.extend(_flatten(value, dotted + "."))
    return keys


def key_exists(key: str) -> bool:
    """A key of some recipe (or an old key still mapped, or one under a mapping field); a name whose first part is
    no recipe's section is not a config key and passes."""
    keys, open_keys, tops = config_keys()
    if "." not in key or key.split(".")[0] not in tops or FILE_SUFFIX.search(key) or key in ALLOWED_KEYS:
        return True
    stem = re.sub(r"\.\*$", "", key)
    parts = stem.split(".")
    under_mapping = any(".".join(parts[:i]) in open_keys for i in range(1, len(parts)))
    prefix = stem.endswith("*") and any(k.startswith(stem[:-1]) for k in keys)
    code_ref = len(parts) == 2 and parts[1] in python_attributes(parts[0])
    return stem in keys or under_mapping or prefix or code_ref


def path_violations(text: str, page: Path) -> list[str]:
    bad = []
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if path in ALLOWED_PATHS or "..." in path:
            continue
        if not (FILE_SUFFIX.search(path) or path.endswith("/") or "*" in path):
            continue  # a metric name (`data/prompts_trained`) or a module attribute, not a file
        if path.startswith("data/") and (REPO / "reinforge" / path).exists():
            continue  # a module named under reinforge/ (`data/prompts.py`), as the tables of sections do
        if "*" in path:
            if not list(REPO.glob(path)):
                bad.append(f"path {path} (matches nothing)")
        elif not (REPO / path).exists():
            bad.append(f"path {path}")
    for target, anchor in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        linked = page.parent / target if target else page
        if not linked.exists():
            bad.append(f"link {target}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            bad.append(f"link {target}#{anchor}")
    return bad


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def command_violations(text: str) -> list[str]:
    table = commands()
    bad = []
    for code in cited_code(text):
        for name, rest in COMMAND.findall(code):
            words = rest.split()
            path = name
            if f"<sub>{name}" not in table[""]:
                bad.append(f"command reinforge {name}")
                continue
            if words and f"<sub>{words[0]}" in table[path]:
                path = f"{path} {words[0]}"
            for flag in re.findall(r"(?<!\S)(--[a-z][a-z-]*)", rest):
                if flag not in table[path]:
                    bad.append(f"flag reinforge {path} {flag}")
    return bad


def script_flag_violations(text: str) -> list[str]:
    """`python bench/x.py --flag`: the script must define the flag (its argparse `add_argument("--flag"`)."""
    bad = []
    for code in cited_code(text):
        for script, rest in SCRIPT.findall(code):
            source = REPO / script
            if not source.is_file():
                continue  # the path check reports it
            defined = source.read_text(encoding="utf-8")
            for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest):
                if f'"{flag}"' not in defined and flag != "--help":
                    bad.append(f"flag {script} {flag}")
    return bad


def make_violations(text: str) -> list[str]:
    """`make TARGET` must be a target of the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(encoding="utf-8"), re.M))
    return [
        f"make target {target}"
        for code in cited_code(text)
        for target in re.findall(r"^\s*make ([a-z][\w-]*)", code)
        if target not in targets
    ]


def violations(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text(encoding="utf-8") if text is None else text
    found = key_violations(text) + path_violations(text, page) + command_violations(text)
    found += script_flag_violations(text) + make_violations(text)
    return [f"{page.relative_to(REPO)}: {v}" for v in found]


# --- the tests -----------------------------------------------------------------------------------------------------


def test_docs_cite_only_what_exists():
    found = [v for page in PAGES for v in violations(page)]
    assert not found, "the docs cite what does not exist:\n" + "\n".join(found)


def test_planted_violations_are_reported():
    page = REPO / "docs" / "planted.md"
    text = (
        "Set `loop.max_stepz=3` (and `generation.no_such.*`), see `configs/no_such.yaml` and [x](no_such.md);\n"
        "[y](distributed.md#no-such-section);\n"
        "```bash\nreinforge grpo --config configs/grpo_demo.yaml --no-such-flag rollout.num_generations=2\n```\n"
        "and `reinforge frobnicate`, `python bench/faults.py --no-such-option`, `make no-such-target`.\n"
        "```yaml\nrollout:\n  num_prompts_per_stepz: 4\n```\n"
    )
    found = violations(page, text)
    for expected in (
        "config key loop.max_stepz",
        "config key generation.no_such.*",
        "config key rollout.num_generations",
        "path configs/no_such.yaml",
        "link no_such.md",
        "link distributed.md#no-such-section",
        "flag reinforge grpo --no-such-flag",
        "command reinforge frobnicate",
        "flag bench/faults.py --no-such-option",
        "make target no-such-target",
        "config key rollout.num_prompts_per_stepz",
    ):
        assert any(v.endswith(expected) for v in found), (expected, found)


def test_what_exists_passes():
    page = REPO / "docs" / "planted.md"
    text = (
        "`loop.max_steps=3`, `env.gym.<task>.url`, `model.lora.rank=16`, `curriculum.*`, `configs/*_demo.yaml`,\n"
        "[distributed](distributed.md), [planner](distributed.md#the-planner), `reinforge env serve --protocol gym`,\n"
        "`reinforge convert CKPT --out DIR`, `python bench/gpu_training_mfu.py --compile`, `make gym-venv`,\n"
        "`grpo.num_prompts_per_step` (an old key), `torch.compile`, `model.safetensors`.\n"
    )
    assert violations(page, text) == []


def test_index_lists_every_page():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {page.name for page in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/README.md does not list {sorted(pages - listed)}"


def test_section_lists_are_the_code_s():
    """docs/configuration.md's table of each recipe's sections, and README's list of `reinforge grpo`'s, are the
    root classes' fields."""
    from reinforge.loops.registry import RECIPES

    table = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `reinforge (\w+)` \| [^|]+ \| ([^|]+) \| ([^|]+) \|$", table, re.M)
    assert {name for name, _, _ in rows} == set(RECIPES)
    for name, sections, settings in rows:
        listed = set(re.findall(r"`(\w+)`", sections + settings))
        assert listed == set(RECIPES[name].config_class.model_fields), name
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    grpo = re.search(r"`reinforge grpo` has (.*?)plus `seed`", readme, re.S)
    assert grpo, "README no longer lists reinforge grpo's sections"
    listed = set(re.findall(r"`(\w+)`", grpo.group(1))) | {"seed"}
    assert listed == set(RECIPES["grpo"].config_class.model_fields)


def test_section_homes_exist():
    """docs/configuration.md's "Where each section lives": each class is defined in the module it names."""
    table = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `[\w.]+` \| `(\w+)` \| ([\w/]+\.py) \|", table, re.M)
    assert len(rows) > 20
    wrong = [f"{cls} in {module}" for cls, module in rows if not _defines(REPO / "reinforge" / module, cls)]
    assert not wrong, f"docs/configuration.md places sections where they are not: {wrong}"


def _defines(module: Path, cls: str) -> bool:
    return module.is_file() and re.search(rf"^class {cls}\b", module.read_text(encoding="utf-8"), re.M) is not None
