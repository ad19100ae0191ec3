"""Character-level text data: the bundled tinyshakespeare (public domain) or any text file."""
from __future__ import annotations

from importlib import resources
import sysconfig
from pathlib import Path

import torch


def bundled_text_path() -> Path:
    return Path(str(resources.files("lpoptim") / "data" / "tinyshakespeare.txt"))


PYTHON_STDLIB = "python-stdlib"


STDLIB_CHARS = 1_500_000  # the small presets' cut (their published figures were measured on it)


def python_stdlib_text(path: str | Path, limit: int = STDLIB_CHARS) -> Path:
    """A second real text on every machine, unrelated to the bundled one: the Python standard library's own
    source (its top-level modules in name order, then its packages' modules in path order, cut at ``limit``
    characters; 10-30 M characters in all, as installed: 10.7 M in one Python 3.12, 31.5 M in a
    3.11 with its tests; train.json records the count), written to ``path`` once. The first 1.5 M characters are
    the same whatever the limit."""
    path = Path(path)
    if not path.exists():
        root = Path(sysconfig.get_paths()["stdlib"])
        nested = sorted(f for f in root.rglob("*.py") if f.parent != root and "site-packages" not in f.parts)
        _concatenate([*sorted(root.glob("*.py")), *nested], path, limit)
    return path


def is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def glob_files(pattern: str) -> list[Path]:
    """The files matching a glob pattern (``**`` recurses), in path order."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if is_glob(part))
    root = Path(*parts[:first]) if first else Path(".")
    return sorted(f for f in root.glob(str(Path(*parts[first:]))) if f.is_file())


def files_text(pattern: str, path: str | Path, limit: int) -> Path:
    """Any corpus on the machine as one text: the files matching ``pattern`` (e.g. '/usr/include/**/*.h', the C
    and C++ headers a Linux machine with a compiler has) in path order, concatenated, undecodable bytes replaced,
    cut at ``limit`` characters, written to ``path``. ValueError if nothing matches."""
    files = glob_files(pattern)
    if not files:
        raise ValueError(f"no file matches {pattern}")
    return _concatenate(files, Path(path), limit)


def _concatenate(files: list[Path], path: Path, limit: int) -> Path:
    parts, size = [], 0
    for f in files:  # read only as far as the limit
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size > limit:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts)[:limit], encoding="utf-8")
    return path


class CharData:
    """Encodes a text file by characters and splits it 90/10 into train and validation."""

    def __init__(self, path: str | Path | None = None, device="cpu"):
        text = Path(path or bundled_text_path()).read_text(encoding="utf-8")
        chars = sorted(set(text))
        self.vocab_size = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(data))
        self.train, self.val = data[:n].to(device), data[n:].to(device)

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator):
        data = self.train if split == "train" else self.val
        ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator).to(data.device)
        offs = torch.arange(block_size, device=data.device)
        x = data[ix[:, None] + offs]
        y = data[ix[:, None] + offs + 1]
        return x, y
