"""Check, on the CPU machine, that the device image's Inductor generates the GPU code of the
embedded engine's compiled decode step and sampling (``EmbeddedEngine(decode_compile=True)``).

The lent GPU machines run torch 2.11 (``benchmarks/gpu_image.txt``); this machine runs the lock's
torch. Inductor's code generation is Python, and most of its Triton path runs without a GPU: with
``torch._inductor.config.cpu_backend = "triton"`` it generates Triton kernels for CPU tensors,
through the same scheduler, fusion and kernel code as for CUDA, and split decisions read the
device's SM count (set here to the H100's 132). As the generated module loads, Triton compiles
each kernel for the GPU (``sm_90``: its front end, its GPU passes and ``ptxas``, which need no
device), and the first kernel launch ends the compilation (``EmulationEnd``). An error before that
is one the GPU would meet too: on 2026-11-28 this reproduced the H100's ``TypeError: list indices
must be integers or slices, not NoneType`` in the sampling's scan, then confirmed the fix
(``rl2gem.rollout.engines.sampling.cumulative_sum``). What it cannot see: choices Inductor makes
from the real device (autotuning among configs, a few heuristics), anything at run time, and
variants compiled again on later calls (only each compilation's first variant is checked); its
kernel counts are an estimate of the GPU's.

    python benchmarks/gpu_codegen.py [--venv DIR] [--layers 8] [--rows 8,256]

builds (once) a virtual environment in ``--venv`` with the image's torch and transformers (PyPI's
CUDA build of torch, about 3 GB) and the lock's other packages, then runs the check in it on a
random Llama of the 1024 x 8 shape (bf16, SmolLM2's vocabulary) at each ``--rows`` as the first
(compiling) bucket. Prints one line per compilation, the Triton kernels and extern calls of the
decode step's generated code and the distinct kernels Triton compiled; exits 1 if one failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0"}  # benchmarks/gpu_image.txt's header


def build_environment(venv: Path) -> Path:
    """``venv`` with the image's torch and transformers and the lock's other packages (no hashes:
    the lock pins them, but its torch and transformers are replaced). Returns its python."""
    python = venv / "bin" / "python"
    marker = venv / ".rl2gem-codegen"
    if marker.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pins = [f"{name}=={version}" for name, version in IMAGE_VERSIONS.items()]
    subprocess.run([python, "-m", "pip", "install", "-q", *pins, "huggingface-hub<2"], check=True)
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    keep = [line.split()[0] for line in lines if re.match(r"^[A-Za-z0-9_.-]+==", line)]
    keep = [pin for pin in keep if pin.split("==")[0].lower() not in (*IMAGE_VERSIONS, "triton", "huggingface-hub")]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write("\n".join(keep))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-r", handle.name], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], check=True)
    marker.touch()
    return python


class EmulationEnd(RuntimeError):
    """Raised at a generated Triton kernel's first launch: its code was generated and compiled."""


#: Triton kernels compiled for the GPU target so far (their names), and that target
COMPILED: list[str] = []
TARGET: list = []


def emulate_gpu_codegen(multiprocessors: int, target: tuple[str, int, int]) -> None:
    """Inductor generates Triton code for CPU tensors, splits as on a GPU of ``multiprocessors``
    SMs, and names a fixed backend hash (Triton's needs an active driver). Each generated kernel
    is compiled by Triton for ``target`` (backend, compute capability, warp size: Triton's front
    end, its GPU passes and ``ptxas``, no device needed) as its module loads, and its first
    launch raises :class:`EmulationEnd`."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils
    import triton
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.hints import DeviceProperties
    from triton.backends.compiler import GPUTarget

    create = DeviceProperties.create.__func__
    DeviceProperties.create = classmethod(
        lambda cls, device: create(cls, device)._replace(multi_processor_count=multiprocessors)
    )
    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    triton_utils.triton_hash_with_backend = lambda: "emulated"
    TARGET[:] = target
    if getattr(triton.compile, "emulated", False):
        return
    compile_for_cpu = triton.compile

    def compile_for_gpu(source, target=None, options=None):
        return compile_for_cpu(source, target=GPUTarget(*TARGET), options=options)

    compile_for_gpu.emulated = True
    triton.compile = compile_for_gpu

    def precompile(self, *args, **kwargs):
        for config in self.configs:
            self._precompile_config(config)
        COMPILED.append(self.inductor_meta.get("kernel_name", self.fn.__name__))

    def run(self, *args, **kwargs):
        name = self.inductor_meta.get("kernel_name", self.fn.__name__)
        if name not in COMPILED:
            raise RuntimeError(f"kernel {name} launched without being compiled for the GPU")
        raise EmulationEnd(f"the kernels were generated and compiled for {tuple(TARGET)} ({len(COMPILED)} so far)")

    triton_heuristics.CachingAutotuner.precompile = precompile
    triton_heuristics.CachingAutotuner.run = run


def generated(error: BaseException | None) -> bool:
    """Whether a compilation's kernels were generated and compiled: their first launch came."""
    return error is not None and EmulationEnd.__name__ in f"{type(error).__name__}: {error}"


def outcome(error: BaseException | None) -> str:
    if error is None:
        return "FAILED: it ran without launching a generated kernel (the emulation did not hold)"
    if generated(error):
        return "code generated, compiled for the GPU"
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"FAILED: {type(error).__name__}: {' / '.join(lines[:3])[:300]}"


def check(layers: int, rows: int) -> bool:
    """Compile the decode step (sampling steps) and the sampling with ``rows`` first; print each
    outcome and the step's kernel counts. Returns whether both generated their code."""
    import numpy as np
    import torch
    import transformers

    from rl2gem.rollout.engines.cuda_graphs import DecodeGraphs
    from rl2gem.rollout.engines.embedded import _KVStore
    from rl2gem.rollout.engines.lean_decoder import LeanDecoder

    torch._dynamo.reset()
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    decoder = LeanDecoder(model, vocab_chunk=config.vocab_size)  # as the engine builds it on CUDA
    graphs = DecodeGraphs(decoder, capture=False, compile_backend="inductor")
    store = _KVStore(layers, 4, 64, torch.bfloat16, "cpu")
    store.reserve(rows, 0, 256)
    store.lo, store.hi, store.slots = 0, 10, rows
    store.mask[:rows, :11] = True
    results = []
    with torch.no_grad():
        try:
            graphs.launch_sample(store, [1] * rows, [10] * rows, [1.0] * rows, [True] * rows, np.zeros((4, rows)))
            results.append(("decode step", None))
        except Exception as error:  # the step's compile error propagates (capture=False)
            results.append(("decode step", error))
        logits = torch.randn(rows, config.vocab_size)
        arguments = (logits, torch.ones(rows), torch.zeros(rows, dtype=torch.bool), torch.rand(rows))
        try:  # the compiled sampling itself: the engine's wrapper would fall back to eager
            torch._dynamo.mark_static(logits, 1)
            graphs._sample_rows.compiled(*arguments)
            results.append(("sampling", None))
        except Exception as error:
            results.append(("sampling", error))
    ok = True
    for name, error in results:
        print(f"| {rows} | {name} | {outcome(error)} |", flush=True)
        ok &= generated(error)
    return ok


def kernel_counts(code_dir: Path) -> str:
    """The Triton kernels and extern calls in the largest generated wrapper's ``call`` (the step's)."""
    modules = [p for p in code_dir.rglob("*.py") if "def call(" in p.read_text(errors="ignore")]
    if not modules:
        return "no generated wrapper found"
    call = max(modules, key=lambda p: p.stat().st_size).read_text().split("def call(", 1)[1]
    return f"{call.count('.run(')} Triton kernels and {call.count('extern_kernels.')} extern calls"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "rl2gem-torch-image")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="8,256", help="the compiling bucket's rows, comma-separated")
    parser.add_argument("--multiprocessors", type=int, default=132, help="SMs (H100 SXM: 132)")
    parser.add_argument("--capability", type=int, default=90, help="the GPU's compute capability (H100/H200: 90)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.inside:
        python = build_environment(args.venv)
        return subprocess.run([python, __file__, "--inside", *(argv if argv is not None else sys.argv[1:])]).returncode
    import os

    import torch

    ok = True
    print(
        f"torch {torch.__version__}, Triton code generated for CPU tensors as for {args.multiprocessors} SMs, "
        f"compiled for sm_{args.capability}\n"
    )
    print("| rows first | compiled | outcome |\n|---:|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a fresh cache: every kernel generated again
            os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")  # Triton's too, removed with it
            emulate_gpu_codegen(args.multiprocessors, ("cuda", args.capability, 32))
            ok &= check(args.layers, rows)
            counts = kernel_counts(Path(cache))
        print(f"\ndecode step at {rows} rows first: {counts} per step")
        print(f"step and sampling: {len(COMPILED)} distinct kernels compiled by Triton")
        print(flush=True)
        COMPILED.clear()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
