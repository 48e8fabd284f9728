"""Every YAML under configs/ validates against the schema, and the README's reference matches the schema."""

from pathlib import Path

import pytest

from phalanx.config.docs import config_reference
from phalanx.config.loader import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_validates(path: Path):
    load_config(str(path))


def test_configs_exist():
    assert list((ROOT / "configs").glob("*.yaml")), "configs/ ships at least the demo config"


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"<!-- config-reference:start -->\n{config_reference()}\n<!-- config-reference:end -->" in readme, (
        "README's config reference is stale: run `python -m phalanx.config.docs --update README.md`"
    )
