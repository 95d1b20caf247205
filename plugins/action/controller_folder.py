# -*- coding: utf-8 -*-
"""Action plugin controller_folder: a folder on the controller, made and proven writable in-process.

The controller-side steps of a run (the results folder, the fleet report's folder) used to be
`file` and `tempfile` tasks delegated to localhost. Each of those starts a Python process that
unpacks and compiles Ansible's module code again: about half a CPU-second per task, measured on
the 2-core CI machine, for a `mkdir`. This plugin does the same work inside the worker that runs
the task, as the invoking user (no become: the controller side never needs root).
Its documentation is library/controller_folder.py.
"""

from __future__ import annotations

import errno
import os
import tempfile

from ansible.plugins.action import ActionBase

ARGUMENT_SPEC = dict(
    path=dict(type="path", required=True),
    mode=dict(type="str", default="0755"),
    writable=dict(type="bool", default=True),
)


def _nearest_existing(path):
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        path = os.path.abspath(os.path.expanduser(args["path"]))
        mode = int(args["mode"], 8)
        result.update(path=path, changed=False, created=False, writable=None)

        if os.path.exists(path) and not os.path.isdir(path):
            return dict(result, failed=True, writable=False, msg="%s exists and is not a folder" % path)

        if self._task.check_mode:
            # Nothing is made: say whether a real run could make it and write there.
            target = path if os.path.isdir(path) else _nearest_existing(path)
            writable = os.access(target, os.W_OK | os.X_OK)
            result.update(changed=not os.path.isdir(path), created=not os.path.isdir(path),
                          writable=writable if args["writable"] else None)
            if args["writable"] and not writable:
                return dict(result, failed=True, msg="%s is not writable by this user (uid %d)" % (target, os.getuid()))
            return result

        if not os.path.isdir(path):
            try:
                os.makedirs(path, mode=mode)
            except FileExistsError:
                pass  # made meanwhile by another host's task of the same run
            except OSError as error:
                return dict(result, failed=True, writable=False,
                            msg="cannot create %s: %s" % (path, error.strerror or error))
            else:
                # makedirs applies the umask; the folder gets the mode asked for.
                os.chmod(path, mode)
                result.update(changed=True, created=True)

        if args["writable"]:
            try:
                handle, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
                os.close(handle)
                os.unlink(probe)
            except OSError as error:
                reason = error.strerror or str(error)
                if error.errno in (errno.EACCES, errno.EPERM):
                    reason = "permission denied for uid %d" % os.getuid()
                return dict(result, failed=True, writable=False, msg="%s is not writable: %s" % (path, reason))
            result["writable"] = True
        return result
