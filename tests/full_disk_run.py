"""A digits training run whose disk fills up once, for the disk-fault tests:

    python -m tests.full_disk_run WORKDIR FILL_AT RECORD [OVERRIDE ...]

Trains `configs.get_config("digits")` with the overrides in WORKDIR (on a small file system the test mounts).
As optimizer step FILL_AT begins, on its first run in WORKDIR only, it records the SHA-256 of every file in WORKDIR
to the JSON file RECORD (outside WORKDIR) and fills WORKDIR's file system to its last 64 KiB with `filler`. Prints
`REPORT: <the run's summary as JSON>` and exits 0, or prints `STOPPED: <the error>` and exits 3 on an OSError.
"""

import hashlib
import json
import os
import shutil
import sys

import keras

from keras_vit.training import configs, trainer

LEFT_FREE = 64 * 1024


def checksums(folder: str) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder` (but the lock and the filler)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name not in ("lock", "filler"):
                with open(path, "rb") as file:
                    found[os.path.relpath(path, folder)] = hashlib.sha256(file.read()).hexdigest()
    return found


class FillDiskOnce(keras.callbacks.Callback):
    def __init__(self, fill_at: int, workdir: str, record: str):
        super().__init__()
        self.fill_at, self.workdir, self.record = fill_at, workdir, record

    def on_train_batch_begin(self, batch, logs=None):
        if trainer.optimizer_iterations(self.model) != self.fill_at or os.path.exists(self.record):
            return
        with open(self.record, "w", encoding="utf-8") as file:
            json.dump(checksums(self.workdir), file)
        size = shutil.disk_usage(self.workdir).free - LEFT_FREE
        with open(os.path.join(self.workdir, "filler"), "wb") as file:
            file.write(b"\0" * size)


if __name__ == "__main__":
    workdir, fill_at, record, *overrides = sys.argv[1:]
    config = configs.apply_overrides(configs.get_config("digits"), overrides)
    try:
        summary = trainer.train_and_evaluate(config, workdir, callbacks=[FillDiskOnce(int(fill_at), workdir, record)],
                                             verbose=0)
    except OSError as error:
        print("STOPPED:", error)
        sys.exit(3)
    print("REPORT:", json.dumps(summary))
