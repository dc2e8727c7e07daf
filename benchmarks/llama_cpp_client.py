"""The project's end of llama.cpp as a peer: a child process on the peer's own interpreter
(benchmarks/peers/llama_cpp_child.py) that keeps `llama_cpp.Llama` models loaded and answers one request at a time,
so that one benchmark process can alternate Pagoda and llama.cpp on the same inputs."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHILD = Path(__file__).parent / "peers" / "llama_cpp_child.py"


def default_llama_venv() -> str:
    """`$PAGODA_LLAMA_VENV`, else where benchmarks/peers/install_llama_cpp.sh installs by default."""
    return os.environ.get("PAGODA_LLAMA_VENV") or str(Path.home() / ".cache" / "pagoda" / "peers" / "llamacpp-venv")


@dataclass
class LlamaGeneration:
    tokens: list[int]
    first_s: float  # from the call to its first token (prompt processing + one step)
    last_s: float  # from the call to its last token

    @property
    def ms_per_token(self) -> float:
        """Decode time per output token after the first."""
        return (self.last_s - self.first_s) * 1000 / max(1, len(self.tokens) - 1)


class LlamaCpp:
    """llama.cpp in a child process: `quantize`, `load`, `generate`, `prefill` (see the child's docstring)."""

    def __init__(self, venv: str | None = None, threads: int = 2) -> None:
        python = Path(venv or default_llama_venv()) / "bin" / "python"
        if not python.is_file():
            raise FileNotFoundError(f"no llama.cpp peer at {python}: run benchmarks/peers/install_llama_cpp.sh")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)  # NOTE: the child must not see the project's packages (nor torch)
        self.threads = threads
        self.proc = subprocess.Popen(
            [str(python), str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def _ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                ans = json.loads(line[3:])
                if "error" in ans:
                    raise RuntimeError(f"llama.cpp {req['op']}: {ans['error']}")
                return ans
        raise RuntimeError(f"llama.cpp child exited (rc {self.proc.wait()}) during {req['op']}")

    def quantize(self, src: str, dst: str, ftype: str) -> float:
        return float(self._ask(op="quantize", src=src, dst=dst, ftype=ftype, threads=self.threads)["seconds"])

    def load(self, name: str, path: str, n_ctx: int = 2048, num_pred_tokens: int = 0) -> str:
        ans = self._ask(
            op="load", name=name, path=path, threads=self.threads, n_ctx=n_ctx, num_pred_tokens=num_pred_tokens
        )
        return str(ans["system_info"])

    def generate(self, name: str, tokens: list[int], max_tokens: int, stop: list[int]) -> LlamaGeneration:
        ans = self._ask(op="generate", name=name, tokens=tokens, max_tokens=max_tokens, stop=stop)
        return LlamaGeneration(ans["tokens"], ans["first_s"], ans["last_s"])

    def prefill(self, name: str, tokens: list[int]) -> float:
        return float(self._ask(op="prefill", name=name, tokens=tokens)["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
