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
