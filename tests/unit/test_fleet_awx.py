"""AWX's own failure notifications (awx/notifications.yml): options the awx.awx collection knows,
no secret written in the data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = yaml.safe_load((REPO / "awx" / "notifications.yml").read_text())["awx_moe_bench_notification_templates"]
COLLECTION = REPO / ".venv" / "collections" / "ansible_collections" / "awx" / "awx"


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t["name"])
def test_notification_template_is_what_awx_takes(template):
    module = COLLECTION / "plugins" / "modules" / "notification_template.py"
    if not module.is_file():
        pytest.skip("awx.awx is not installed in .venv/collections")
    documentation = yaml.safe_load(re.search(r'DOCUMENTATION = r?[\'"]{3}(.*?)[\'"]{3}', module.read_text(), re.S).group(1))
    assert not set(template) - set(documentation["options"])
    assert template["notification_type"] in documentation["options"]["notification_type"]["choices"]
    assert set(template["messages"]) <= {"started", "success", "error", "workflow_approval"}
    assert "error" in template["messages"]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t["name"])
def test_no_secret_in_the_data(template):
    password = template["notification_configuration"].get("password")
    assert password is None or re.fullmatch(r"\{\{ awx_moe_bench_[a-z_]+ \}\}", password)
