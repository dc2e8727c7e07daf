"""A model directory's config.json as written, in transformers' base config class: no tokenizer, no torch.

NOTE: its own module so that the worker's import path (model_runner -> model_loader) reads config.json without
importing `model_files`, whose `AutoTokenizer` import pulls in transformers' tokenizer stack. On the GPU image
(torch 2.11+cu130, transformers 5.17, triton installed) that chain reached `transformers.generation.utils` ->
`masking_utils` -> `torch._dynamo`, whose utils import triton: Triton in the CPU engine, which
tests/kernels/test_triton_mode.py::test_cpu_kernels_and_the_cpu_engine_import_no_triton forbids (seen on the GPU image;
the CPU machine's transformers 5.23 and CPU torch do not take that path, so only the GPU run shows it).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PretrainedConfig


def read_config_json(model_dir: str) -> dict[str, object]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def read_config_file(model_dir: str, raw: dict[str, object] | None = None) -> PretrainedConfig:
    """config.json as written, in transformers' base config class (no model-specific defaults filled in).

    NOTE: `AutoConfig` imports the model's own config class, and in transformers 5 that import pulls in
    `torch._dynamo` and the hub-kernel integrations: 2.3 s of CPU in the worker and 3.3 s in the frontend on this
    machine, both on `pagoda serve`'s start-up path. The base class needs none of that. `raw`: the file, if read.
    """
    config = PretrainedConfig.from_dict(read_config_json(model_dir) if raw is None else raw)
    config._name_or_path = model_dir  # what AutoConfig records; AutoTokenizer matches it against known hub ids
    return config
