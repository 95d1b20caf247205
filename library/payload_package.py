#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Documentation of the action plugin payload_package (plugins/action/payload_package.py).

It runs on the controller inside Ansible's worker; there is no module code to send anywhere.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: payload_package
short_description: Pack the benchmark payload once on the controller, reproducibly
description:
  - Packs the folder O(src) into one tar (the folder's name at its root, names sorted, mtime 0,
    owner 0:0, no C(__pycache__) folders or C(.pyc) files), so the same files always give the
    same archive and its sha256 says whether a host already has this payload.
  - The archive is written to this ansible-playbook run's own temporary folder, named by its
    content. Every host of the run reuses it, and Ansible removes it when the run ends.
  - Returns the sha256 of every packed file, to check the unpacked copy on the host against.
  - Runs inside Ansible's worker process and starts no module.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  src:
    description: The payload folder on the controller.
    type: path
    required: true
attributes:
  check_mode:
    support: full
    details: Packs in check mode too (only this run's temporary folder is written).
"""

EXAMPLES = r"""
- name: Pack the payload
  payload_package:
    src: "{{ playbook_dir }}/../files/moe_bench"
  register: package
"""

RETURN = r"""
path:
  description: The archive on the controller.
  returned: success
  type: str
checksum:
  description: sha256 of the archive.
  returned: success
  type: str
size:
  description: Size of the archive in bytes.
  returned: success
  type: int
files:
  description: sha256 of every packed file, by its path inside O(src).
  returned: success
  type: dict
"""
