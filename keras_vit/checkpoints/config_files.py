"""The JSON files beside a weights file (a `save_pretrained` folder, a hub snapshot): `config.json` (transformers'
model config, or timm's `save_for_hf` config) and `preprocessor_config.json` (transformers' image processor).
`Beside` reads each at most once per checkpoint, for every reader that needs it (`preprocessing`, `torch_layout`).
"""

from __future__ import annotations

import json
import os

CONFIG = "config.json"
PROCESSOR = "preprocessor_config.json"


class Beside:
    """The JSON files in the folder of `weights_path`, each read on first use and kept."""

    def __init__(self, weights_path: str):
        self.folder = os.path.dirname(os.path.abspath(weights_path))
        self._read: dict[str, dict | None] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def json(self, name: str) -> dict | None:
        """The file `name` as a dict; None where there is none. ValueError naming it when it is unreadable."""
        if name not in self._read:
            path = self.path(name)
            self._read[name] = read_json(path) if os.path.isfile(path) else None
        return self._read[name]

    @property
    def config(self) -> dict | None:
        return self.json(CONFIG)

    @property
    def processor(self) -> dict | None:
        return self.json(PROCESSOR)


def read_json(path: str) -> dict:
    """A JSON object from `path`; ValueError naming the file when it is unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"Could not read {path!r}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path!r}: expected a JSON object, found {type(config).__name__}.")
    return config
