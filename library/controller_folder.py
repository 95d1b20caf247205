#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Documentation of the action plugin controller_folder (plugins/action/controller_folder.py).

It runs on the controller inside Ansible's worker; there is no module code to send anywhere.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: controller_folder
short_description: Make a folder on the controller and prove this user can write there
description:
  - Creates O(path) on the controller, as the user running ansible-playbook (never with become),
    when it is missing, and with O(writable) creates and removes a probe file in it.
  - Fails with the reason (not a folder, permission denied for uid N, disk full) when it cannot.
  - Runs inside Ansible's worker process and starts no module (a C(file) or C(tempfile) task
    delegated to localhost starts a Python process that compiles Ansible's module code again).
  - In check mode nothing is made; it fails when a real run could not write there.
version_added: "1.0.0"
author:
  - moe-bench-ops maintainers
options:
  path:
    description: The folder.
    type: path
    required: true
  mode:
    description: Mode of a folder it creates (octal string).
    type: str
    default: "0755"
  writable:
    description: Prove the folder writable with a probe file.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
"""

EXAMPLES = r"""
- name: Make the results folder and check that it is writable
  controller_folder:
    path: "{{ playbook_dir }}/../results/{{ inventory_hostname }}"
"""

RETURN = r"""
path:
  description: The folder, absolute.
  returned: always
  type: str
created:
  description: Whether it was created (in check mode, whether it would be).
  returned: always
  type: bool
writable:
  description: Whether the probe file could be written; null when O(writable) is false.
  returned: always
  type: bool
"""
