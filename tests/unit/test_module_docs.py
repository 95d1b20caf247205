"""The modules' DOCUMENTATION matches their argument_spec and renders in ansible-doc."""

from __future__ import annotations

import ast
import subprocess

import pytest
import yaml

from moe_bench_testlib import REPO, VENV_BIN, ansible_env

MODULES = ["gpu_memory", "service_health", "bench_job"]


def _argument_spec(path):
    """The argument_spec literal passed to AnsibleModule(), read from the source without running it."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "AnsibleModule":
            for keyword in node.keywords:
                if keyword.arg == "argument_spec":
                    return _literal(keyword.value)
    raise AssertionError("no AnsibleModule(argument_spec=...) in %s" % path)


def _literal(node):
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
        return dict((keyword.arg, _literal(keyword.value)) for keyword in node.keywords)
    return ast.literal_eval(node)


def _doc_strings(path):
    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("DOCUMENTATION", "EXAMPLES", "RETURN"):
                found[node.targets[0].id] = yaml.safe_load(node.value.value)
    return found


def _walk_descriptions(document, where):
    if isinstance(document, dict):
        for key, value in document.items():
            if key in ("description", "short_description"):
                items = value if isinstance(value, list) else [value]
                for item in items:
                    assert isinstance(item, str), "%s: description %r is not text (a ': ' in it?)" % (where, item)
            _walk_descriptions(value, "%s.%s" % (where, key))
    elif isinstance(document, list):
        for item in document:
            _walk_descriptions(item, where)


def _compare_options(documented, spec, where):
    assert set(documented) == set(spec), "%s: documented %s, argument_spec %s" % (where, sorted(documented), sorted(spec))
    for name, option in spec.items():
        doc = documented[name]
        assert doc.get("type", "str") == option.get("type", "str"), "%s.%s type" % (where, name)
        assert bool(doc.get("required", False)) == bool(option.get("required", False)), "%s.%s required" % (where, name)
        assert doc.get("default") == option.get("default"), "%s.%s default" % (where, name)
        if option.get("elements"):
            assert doc.get("elements") == option["elements"], "%s.%s elements" % (where, name)
        if option.get("options"):
            _compare_options(doc.get("suboptions", {}), option["options"], "%s.%s" % (where, name))


@pytest.mark.parametrize("name", MODULES)
def test_documentation_matches_argument_spec(name):
    path = REPO / "library" / ("%s.py" % name)
    docs = _doc_strings(path)
    assert set(docs) == {"DOCUMENTATION", "EXAMPLES", "RETURN"}
    assert docs["DOCUMENTATION"]["module"] == name
    _walk_descriptions(docs["DOCUMENTATION"], name)
    _walk_descriptions(docs["RETURN"], name + " RETURN")
    _compare_options(docs["DOCUMENTATION"]["options"], _argument_spec(path), name)
    for example in docs["EXAMPLES"]:
        assert example["name"][0].isupper(), example["name"]


@pytest.mark.parametrize("relative_path", ["plugins/callback/moe_bench_progress.py"])
def test_plugin_documentation_parses(relative_path):
    docs = _doc_strings(REPO / relative_path)
    _walk_descriptions(docs["DOCUMENTATION"], relative_path)


def _filter_names():
    """Every filter the project's filter plugins register."""
    import importlib.util
    names = []
    for path in sorted((REPO / "plugins" / "filter").glob("*.py")):
        spec = importlib.util.spec_from_file_location("filter_" + path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names += sorted(module.FilterModule().filters())
    return names


def test_every_filter_has_documentation_that_renders(tmp_path):
    names = _filter_names()
    assert len(names) >= 10, names
    for name in names:
        doc = yaml.safe_load((REPO / "plugins" / "filter" / ("%s.yml" % name)).read_text())
        assert doc["DOCUMENTATION"]["name"] == name
        _walk_descriptions(doc["DOCUMENTATION"], name)
        assert doc["EXAMPLES"].strip() and "_value" in doc["RETURN"], name
    completed = subprocess.run(
        [str(VENV_BIN / "ansible-doc"), "-t", "filter", *names],
        cwd=REPO, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert completed.returncode == 0, completed.stderr
    plain = completed.stdout.replace("\x1b[1m", "").replace("\x1b[0m", "")
    for name in names:
        # Each filter shows its own documentation, not a neighbour's.
        assert "> FILTER %s (%s)" % (name, REPO / "plugins" / "filter" / ("%s.yml" % name)) in plain, name


def test_ansible_doc_renders_every_module(tmp_path):
    completed = subprocess.run(
        [str(VENV_BIN / "ansible-doc"), "-M", str(REPO / "library"), *MODULES],
        cwd=REPO, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert completed.returncode == 0, completed.stderr
    assert "ERROR" not in completed.stderr, completed.stderr
    for name in MODULES:
        assert "> MODULE %s" % name in completed.stdout.replace("\x1b[1m", "").replace("\x1b[0m", "")
