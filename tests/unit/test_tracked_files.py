"""No tracked file names a path outside the repository: a workspace or home directory, or a folder beside it, which
exist only on some machine and never in a user's clone (the project stands alone). The rule is a function of the
tracked files' text, so a test below also plants a violation and checks that the rule sees it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Paths that exist only on some machine, never in a user's clone: a workspace or home directory, or a folder beside
# the repository. /tmp/ is allowed: the code and docs use it for scratch output and inside the sandbox, not to cite
# a file the user should have.
OUTSIDE_PATH = re.compile(r"(?<![\w.~-])/(work|home|root|Users)/|\.\./shared\b")
# Dataset and model files hold records and weights, not prose; their READMEs and scripts are checked.
DATA_FOLDERS = ("data/", "tests/data/", "models/")
DATA_SUFFIXES = (".jsonl", ".json", ".safetensors", ".parquet")
THIS_FILE = "tests/unit/test_tracked_files.py"  # it spells the patterns it looks for


def outside_paths(files: dict[str, str]) -> list[str]:
    """Lines of {path: text} that name a path outside the repository."""
    return [
        f"{path}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}"
        for path, text in sorted(files.items())
        for number, line in enumerate(text.splitlines(), 1)
        for match in OUTSIDE_PATH.finditer(line)
    ]


def tracked_text_files() -> dict[str, str]:
    """The repository's tracked files, and new ones git does not ignore, that hold prose or code (not data records,
    weights or binaries)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to read")
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listing = subprocess.run(command, cwd=REPO, capture_output=True, check=True, text=True).stdout
    files = {}
    for path in listing.split("\0"):
        is_data = path.startswith(DATA_FOLDERS) and path.endswith(DATA_SUFFIXES)
        if not path or path == THIS_FILE or is_data or not (REPO / path).is_file():
            continue
        raw = (REPO / path).read_bytes()
        if b"\0" not in raw:
            files[path] = raw.decode("utf-8", errors="replace")
    return files


def test_no_tracked_file_names_a_path_outside_the_repository():
    assert not (problems := outside_paths(tracked_text_files())), "\n".join(problems)


def test_a_path_outside_the_repository_is_reported():
    files = {
        "docs/a.md": "see /work/shared/docs/protocol.md\nor ../shared/docs/protocol.md\n",
        "reinforge/b.py": "# /home/user/notes, https://example.com/work/page, /tmp/scratch, docs/work/x\n",
    }
    assert outside_paths(files) == [
        "docs/a.md:1: '/work/' in 'see /work/shared/docs/protocol.md'",
        "docs/a.md:2: '../shared' in 'or ../shared/docs/protocol.md'",
        "reinforge/b.py:1: '/home/' in '# /home/user/notes, https://example.com/work/page, /tmp/scratch, docs/work/x'",
    ]
