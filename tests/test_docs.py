"""The repository explains itself: every module docs/architecture.md names exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_every_path_in_the_architecture_document_exists():
    text = ARCHITECTURE.read_text()
    paths = set(re.findall(r"`((?:apps|client|tests|bench|docs|scheduler_site)/[\w/.]+)`", text))
    assert len(paths) > 20
    missing = sorted(path for path in paths if not (ROOT / path.rstrip("/")).exists())
    assert not missing, missing


def test_every_module_and_name_in_the_architecture_document_resolves():
    text = ARCHITECTURE.read_text()
    dotted = set(re.findall(r"`(apps(?:\.\w+)+)`", text))
    assert len(dotted) > 10
    unresolved = []
    for name in sorted(dotted):
        parts = name.split(".")
        # The longest importable prefix, then attributes.
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            try:
                target = importlib.import_module(module)
            except ImportError:
                continue
            for attribute in parts[cut:]:
                target = getattr(target, attribute, None)
            if target is None:
                unresolved.append(name)
            break
        else:
            unresolved.append(name)
    assert not unresolved, unresolved


def test_every_test_the_documents_cite_exists():
    """`tests/…py::test_name` (and `::other` after it, in the same file) in README.md and docs/
    name tests that exist: a renamed or removed test leaves the claim it backed unsupported."""
    cited, missing = 0, []
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in document.read_text().splitlines():
            current = None
            for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", line):
                current = path or current
                if current is None:
                    continue
                cited += 1
                source = (ROOT / current).read_text() if (ROOT / current).exists() else ""
                if not re.search(rf"^(?:async )?def {name}\(", source, re.MULTILINE):
                    missing.append(f"{document.name}: {current}::{name}")
    assert cited > 20
    assert not missing, missing
