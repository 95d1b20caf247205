# -*- coding: utf-8 -*-
"""Action plugin payload_package: the benchmark payload packed once on the controller, in-process.

One reproducible tar of the payload folder (sorted names, mtime 0, owner 0:0, no __pycache__ or
.pyc), its sha256 and every file's sha256, written to this ansible-playbook run's own temporary
folder (Ansible removes it when the run ends) and reused by every host of the run. It replaces a
tempfile, a tar command, a stat, a find and a file task delegated to localhost: each of those
started a Python process on the controller (about half a CPU-second each on the 2-core CI
machine), for every host. Its documentation is library/payload_package.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

from ansible import constants as C
from ansible.plugins.action import ActionBase

ARGUMENT_SPEC = dict(src=dict(type="path", required=True))
SKIPPED_DIRS = {"__pycache__"}
SKIPPED_SUFFIXES = (".pyc",)


def _walk(src):
    """(relative path, absolute path, is_dir) of the payload, folders first, names sorted."""
    base = os.path.dirname(src)
    entries = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        entries.append((os.path.relpath(root, base), root, True))
        for name in sorted(files):
            if not name.endswith(SKIPPED_SUFFIXES):
                full = os.path.join(root, name)
                entries.append((os.path.relpath(full, base), full, False))
    return sorted(entries, key=lambda entry: entry[0])


def _tarinfo(name, full, is_dir):
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    mode = os.stat(full).st_mode & 0o7777
    if is_dir:
        info.type = tarfile.DIRTYPE
    else:
        info.size = os.path.getsize(full)
    info.mode = mode
    return info


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        src = os.path.abspath(args["src"].rstrip("/"))
        if not os.path.isdir(src):
            return dict(result, failed=True, msg="the payload folder %s does not exist on the controller" % src)

        entries = _walk(src)
        files = {}
        buffer = io.BytesIO()
        # format=GNU: GNU tar and Python's tarfile read it the same way; no pax timestamps that
        # would make the same files give another archive.
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
            for name, full, is_dir in entries:
                info = _tarinfo(name, full, is_dir)
                if is_dir:
                    archive.addfile(info)
                    continue
                with open(full, "rb") as handle:
                    data = handle.read()
                files[os.path.relpath(full, src)] = hashlib.sha256(data).hexdigest()
                archive.addfile(info, io.BytesIO(data))
        data = buffer.getvalue()
        checksum = hashlib.sha256(data).hexdigest()

        # Named by content in this run's own temporary folder: the hosts of one run share it, and
        # Ansible removes the folder when ansible-playbook exits. It is only ever written whole
        # (os.replace), so a file of that name already holds these bytes.
        folder = os.path.join(C.DEFAULT_LOCAL_TMP, "moe_bench_payload")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, "%s-%s.tar" % (os.path.basename(src), checksum))
        if not os.path.exists(path):
            partial = "%s.%d.part" % (path, os.getpid())
            with open(partial, "wb") as handle:
                handle.write(data)
            os.replace(partial, path)
        result.update(changed=False, path=path, checksum=checksum, size=len(data), files=files)
        return result
