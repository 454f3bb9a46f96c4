"""The house's shape, as issue 32 states it: the public paths users and docs name keep resolving, the
package root holds the public surface only, no module grows past 450 lines, and `import asyncpage`
loads no measurement code. The layers themselves are import-linter's contract (pyproject.toml), run
by `make lint` and `make test`."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import asyncpage

PACKAGE = Path(asyncpage.__file__).parent

# Every public name and module path that ../shared/DESIGN.md, the README or the docs name.
PUBLIC = {
    "asyncpage": ["AsyncEngine", "RequestStream", "SamplingParams", "Choice", "EngineStats", "GenerateOutput",
                  "RequestMetrics", "StreamChunk", "TokenLogprob", "AsyncPageError", "EngineDeadError",
                  "EngineLoopError", "EngineNotRunningError", "ExtractionError", "GrammarError",
                  "GrammarTimeoutError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError",
                  "QueueFullError", "RequestFailedError", "SamplingError", "__version__"],
    "asyncpage.engine": ["AsyncEngine"],
    "asyncpage.errors": ["QueueFullError", "InvalidRequestError"],
    "asyncpage.params": ["SamplingParams"],
    "asyncpage.outputs": ["GenerateOutput", "StreamChunk"],
    "asyncpage.openai": ["app", "client", "http_client", "MAX_REQUEST_BYTES"],
    "asyncpage.metrics": ["PrometheusMetrics"],
    "asyncpage.ray": ["extract_dataset", "run_job"],
    "asyncpage.disagg": ["DisaggEngine"],
    "asyncpage.chat": ["chat", "chat_stream", "ChatResult", "ChatDelta", "ToolCall", "Usage"],
    "asyncpage.extract": ["ExtractResult", "ExtractError", "json_params", "decode_value", "beams_per_record"],
    "asyncpage.kernels": [],
    "asyncpage.grammars": [],
    "asyncpage.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_path_resolves(module: str) -> None:
    if module == "asyncpage.ray":
        pytest.importorskip("ray")
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"


def test_the_package_root_is_the_public_surface_only() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 12, root


def test_no_module_is_over_450_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_importing_asyncpage_loads_no_measurement_or_optional_code() -> None:
    code = ("import sys, asyncpage; print(sorted(m for m in sys.modules if m.startswith('asyncpage.bench') "
            "or m in ('asyncpage.openai', 'asyncpage.ray', 'matplotlib', 'starlette', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# Hides PyPI's `kernels` (module and metadata) from the interpreter it runs in.
_HIDE_KERNELS = """
import sys, importlib.machinery as mach, importlib.metadata as md
class NoKernels:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "kernels" or name.startswith("kernels."):
            path = [p for p in (sys.path if path is None else path) if "site-packages" not in p]
            spec = mach.PathFinder.find_spec(name, path, target)
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return spec
        return None
sys.meta_path.insert(0, NoKernels)
find = mach.PathFinder.find_distributions
mach.PathFinder.find_distributions = staticmethod(
    lambda context=md.DistributionFinder.Context(): (d for d in find(context) if d.metadata["Name"] != "kernels"))
"""


@pytest.mark.parametrize("pypi_kernels", ["as installed", "absent"])
def test_the_checkouts_kernels_folder_never_shadows_pypis_kernels_which_transformers_imports(pypi_kernels: str) -> None:
    # Run from the checkout's root (as `python -m ...` and pytest run here), `kernels/` is importable as a
    # top-level `kernels`: that is PyPI's package, which transformers imports when it finds it.
    root = Path(__file__).resolve().parents[1]
    code = ((_HIDE_KERNELS if pypi_kernels == "absent" else "") +
            "import importlib.metadata as m, sys\n"
            "try:\n    m.distribution('kernels'); installed = True\n"
            "except m.PackageNotFoundError:\n    installed = False\n"
            "import kernels\n"
            "print(getattr(kernels, '__file__', None) or 'absent', installed)\n"
            "from transformers import LlamaConfig\n"
            "from transformers.utils.import_utils import is_kernels_available\n"
            "import asyncpage.kernels.attention_kernels as a\n"
            "print(a.__file__, is_kernels_available())\n"
            "try:\n    import kernels.attention_kernels\n    print('submodule')\n"
            "except ImportError:\n    print('no submodule')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    where, installed = lines[0].rsplit(" ", 1)
    ours, available = lines[1].rsplit(" ", 1)
    assert Path(ours).parent == root / "kernels"  # asyncpage's own kernels load from the checkout
    if installed == "False":
        # No distribution: an empty stand-in without __file__ or submodules, which transformers' availability
        # check (it imports a package without metadata) reads as absent; its models still import.
        assert where == "absent" and available == "False" and lines[2] == "no submodule"
    else:
        assert pypi_kernels == "as installed"
        assert Path(where).parent != root / "kernels" and "site-packages" in where
