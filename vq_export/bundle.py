"""`vq-gguf export`: a folder to hand on with a quantized model, and `vq-gguf verify` for it.

Always: the GGUF, its model card (README.md) and manifest.json (sha256 of every file, the model's metadata, bits
per weight). With --bundle, for desktop apps: the patched shared libraries this platform needs, the headers of
the C API (llama.h and the ggml headers it includes) and a C example that chats through it; the manifest then
also names the library build. The libraries find each other through $ORIGIN, so the folder can move. On x86-64
they come from the portable build (native/build.py): ggml's CPU backend as one library per instruction-set level,
of which ggml loads the best one the running CPU supports, so the folder runs on any x86-64 CPU (`vq-gguf export
--native` ships the build for this machine's CPU instead).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gguf import GGUFReader

from vq_gguf.atomic import sha256
from vq_gguf.native.build import NATIVE

from . import ggml_vq
from .bpw import count

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
EXAMPLE = NATIVE / "example" / "generate.c"
METADATA_KEYS = ("general.name", "general.architecture", "general.size_label", "general.license",
                 ggml_vq.METHOD_KEY, ggml_vq.PRESET_KEY, ggml_vq.FORMAT_KEY)


class BundleError(ValueError):
    """The folder does not match its manifest, or cannot be made."""


def model_metadata(path: Path) -> dict:
    """The GGUF keys a reader of the manifest wants, plus the context length of the architecture."""
    reader = GGUFReader(path)
    out = {}
    for key in METADATA_KEYS:
        field = reader.get_field(key)
        if field is not None:
            out[key] = field.contents()
    arch = out.get("general.architecture")
    field = reader.get_field(f"{arch}.context_length") if arch else None
    if field is not None:
        out["context_length"] = field.contents()
    out["chat_template"] = reader.get_field("tokenizer.chat_template") is not None
    return out


def bits_summary(path: Path) -> dict:
    bits = count(path)
    return {"params": bits.params, "file_bytes": bits.file_bytes, "bpw_block_linears": round(bits.linear_bpw, 4),
            "bpw_file": round(bits.file_bpw, 4),
            "types_block_linears": {t: round(share, 4) for t, share in bits.linear_types().items()}}


# --- the libraries ---------------------------------------------------------------------------------------

def _dynamic(lib: Path) -> tuple[str, list[str]]:
    """(SONAME, NEEDED names) of an ELF shared library."""
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    names = {kind: [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if f"({kind})" in line]
             for kind in ("SONAME", "NEEDED")}
    return (names["SONAME"] or [lib.name])[0], names["NEEDED"]


def shared_libraries(lib_dir: Path) -> dict[str, Path]:
    """{name: file} of what a program needs from the build folder: libllama and every library of the folder it
    loads, directly or not, by SONAME (ELF NEEDED names; system libraries such as libc, libstdc++ or libgomp are
    not in the build folder, not ours to ship), and in a portable build the CPU backend variants, which ggml loads
    at run time (no library NEEDs them)."""
    from vq_gguf.native.build import cpu_variants
    if platform.system() != "Linux" or shutil.which("readelf") is None:
        raise BundleError("the libraries can be collected only on Linux, with readelf (binutils)")
    if not (lib_dir / "libllama.so").exists():
        raise BundleError(f"no libllama.so in {lib_dir}: run `vq-gguf build`")
    found: dict[str, Path] = {}
    todo = [lib_dir / "libllama.so"]
    while todo:
        soname, needed = _dynamic(todo.pop())
        if soname not in found:
            found[soname] = (lib_dir / soname).resolve()
            todo += [lib_dir / n for n in needed if n not in found and (lib_dir / n).exists()]
    return found | {f"libggml-cpu-{v}.so": lib_dir / f"libggml-cpu-{v}.so" for v in cpu_variants(lib_dir)}


def headers(tree: Path) -> list[Path]:
    """llama.h and the headers it includes, directly or not (all in the tree's include folders)."""
    folders = [tree / "include", tree / "ggml" / "include"]
    found: dict[str, Path] = {}
    todo = ["llama.h"]
    while todo:
        name = todo.pop()
        path = next((f / name for f in folders if (f / name).exists()), None)
        if path is None or name in found:
            continue  # a system header
        found[name] = path
        todo += re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.MULTILINE)
    return sorted(found.values())


def library_build(variants: list[str]) -> dict:
    from vq_gguf.native.build import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON_VERSION, PATCH
    from vq_gguf.tools.environment import versions
    v = versions()
    return {
        "llama.cpp commit": LLAMA_CPP_COMMIT,
        "llama.cpp source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist, vendor/llama.cpp",
        "patch sha256": sha256(PATCH),
        "vq-gguf git commit": v["vq-gguf git commit"],
        "vq-gguf uncommitted changes": v["vq-gguf uncommitted changes"],
        "platform": f"{platform.system()}-{platform.machine()}",
        "cpu flags": (f"portable: ggml loads the best of its CPU variants {', '.join(variants)} that the running CPU supports"
                      if variants else "GGML_NATIVE=ON: built for the instruction set of the building machine's CPU"),
        "cpu variants": variants,
    }


# --- export and verify -----------------------------------------------------------------------------------

def export(model: Path, out: Path, *, bundle: bool = False, lib_dir: Path | None = None, archive: bool = False,
           results: Path | None = None) -> Path:
    """Write the folder `out` (replaced if it exists); returns it, or the .tar.gz made from it with archive.
    bundle: with the libraries of the build folder `lib_dir` (default: the portable build's on x86-64, else the
    native build's)."""
    from .model_card import find_results, render

    model = Path(model)
    if not model.is_file():
        raise FileNotFoundError(f"model file {model} does not exist")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy2(model, tmp / model.name)
    manifest = {"manifest_version": MANIFEST_VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "model": {"file": model.name, "metadata": model_metadata(model), "bits": bits_summary(model)}}
    if bundle:
        from vq_gguf.native.build import cpu_variants, tree_dir
        lib_dir = Path(lib_dir or default_lib_dir())
        for soname, lib in shared_libraries(lib_dir).items():
            _copy(lib, tmp / "lib" / soname)
            linker_name = soname.split(".so")[0] + ".so"  # what `cc -lNAME` looks for
            if linker_name != soname:
                (tmp / "lib" / linker_name).symlink_to(soname)
        variants = cpu_variants(lib_dir)
        for h in headers(tree_dir()):
            _copy(h, tmp / "include" / h.name)
        _copy(EXAMPLE, tmp / "example" / EXAMPLE.name)
        manifest["library"] = library_build(variants)
    (tmp / "README.md").write_text(render(manifest, find_results(model, results), bundle=bundle))
    manifest["files"] = {p.relative_to(tmp).as_posix(): _entry(p) for p in sorted(tmp.rglob("*")) if not p.is_dir()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if not archive:
        return out
    tar_path = out.with_name(out.name + ".tar.gz")
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    return tar_path


def portable() -> bool:
    """Bundles from the portable build: on x86-64 Linux, where ggml has CPU variants that native/build.py makes."""
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def default_lib_dir() -> Path:
    from vq_gguf.native.build import bin_dir, portable_bin_dir
    return portable_bin_dir() if portable() else bin_dir()


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _entry(p: Path) -> dict:
    """A file's manifest entry: its sha256 and size, or for a symbolic link its target."""
    if p.is_symlink():
        return {"symlink": os.readlink(p)}
    return {"sha256": sha256(p), "bytes": p.stat().st_size}


def verify(path: Path, load: Callable[[Path], None] | None = None) -> dict:
    """The manifest of a folder or .tar.gz made by export, checked against the files; raises BundleError
    listing every missing, changed or unlisted file. Then, when given, `load` checks the model file (it raises
    on a file that the manifest lists but that llama.cpp refuses)."""
    path = Path(path)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
            folders = [p for p in Path(tmp).iterdir() if p.is_dir()]
            if len(folders) != 1:
                raise BundleError(f"{path}: expected one folder in the archive, found {len(folders)}")
            return verify(folders[0], load)
    if not path.is_dir():
        raise BundleError(f"{path} is not an exported folder or .tar.gz")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        listed = manifest["files"]
    except FileNotFoundError:
        raise BundleError(f"{path}: no {MANIFEST}, so nothing to verify against (was it made by `vq-gguf export`?)") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BundleError(f"{path}/{MANIFEST} is not a valid manifest: {e}") from None
    problems = []
    for name, want in listed.items():
        p = path / name
        if not (p.is_file() or p.is_symlink()):
            problems.append(f"missing: {name}")
        elif (got := _entry(p)) != want:
            what = f"link to {got['symlink']}" if "symlink" in got else f"sha256 {got['sha256'][:16]}..."
            said = f"link to {want['symlink']}" if "symlink" in want else f"sha256 {want.get('sha256', '?')[:16]}..."
            problems.append(f"changed: {name} ({what}, manifest says {said})")
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if not p.is_dir()}
    problems += [f"not in the manifest: {name}" for name in sorted(present - set(listed) - {MANIFEST})]
    if problems:
        raise BundleError(f"{path} does not match its {MANIFEST}:\n  " + "\n  ".join(problems))
    if load is not None:
        model = manifest.get("model", {}).get("file") if isinstance(manifest.get("model"), dict) else None
        if model not in listed:
            raise BundleError(f"{path}/{MANIFEST} names no model file among its files")
        load(path / model)
    return manifest
