"""vq-gguf: quantize models to VQ-GGUF, inspect the files, chat with them through the patched llama.cpp.

    vq-gguf build                      build the patched llama.cpp (fetch, check, patch, compile)
    vq-gguf quantize --preset 2bit     quantize the default model (or --model PATH)
    vq-gguf selfgen --out S.txt        calibration text the model writes itself (an ordinary --calib file)
    vq-gguf teacher --out T.npz        the float model's states on calibration windows, for finetune
    vq-gguf finetune FILE --teacher T.npz   end-to-end fine-tuning of FILE's codebooks and norms (GPU if any)
    vq-gguf inspect FILE               tensor types, VQ geometry, bits per weight counted from the file
    vq-gguf clean [FOLDER ...]         remove what interrupted runs left (resume folders no process holds)
    vq-gguf chat FILE --prompt "..."   chat one prompt (or interactively without --prompt)
    vq-gguf serve FILE                 llama-server on FILE: an OpenAI-compatible API on 127.0.0.1:8080
    vq-gguf export FILE --out DIR      FILE with its model card and manifest (--bundle: + libraries, C example)
    vq-gguf verify DIR                 check an exported folder against its manifest, and load its model
    vq-gguf wheel                      a llama-cpp-python wheel of the patched llama.cpp (x86-64: any CPU)
    vq-gguf demo                       build, quantize the default model, compare with llama.cpp, chat
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .bpw import describe
from .paths import home


def default_out(preset: str) -> Path:
    from .default_model import NAME
    return home() / "out" / f"{NAME}.vq-{preset}.gguf"


def cmd_build(args) -> None:
    from vq_gguf.native.build import build, build_cross, build_portable, build_sanitize
    if args.sanitize:
        print(build_sanitize(jobs=args.jobs))
    elif args.portable:
        print(build_portable(jobs=args.jobs))
    elif args.cross:
        print(build_cross(args.cross, jobs=args.jobs))
    else:
        print(build(server=args.server, rpc=args.rpc, jobs=args.jobs))


def preset_from_args(args):
    """The preset named by --preset with the quantize flags applied. A flag that changes the geometry (v, k,
    k_res) replaces the preset's per-tensor overrides; the other settings apply to them too."""
    import dataclasses

    from .presets import PRESETS, load

    presets = {**PRESETS, **(load(Path(args.preset_file)) if args.preset_file else {})}
    if args.preset not in presets:
        raise SystemExit(f"unknown preset {args.preset!r}; the presets are {', '.join(presets)}")
    preset = presets[args.preset]
    changes = {k: getattr(args, k) for k in CONFIG_FLAGS if getattr(args, k) is not None}
    if changes:
        geometry = any(k in GEOMETRY_FLAGS for k in changes)
        overrides = () if geometry else tuple((key, dataclasses.replace(c, **changes)) for key, c in preset.overrides)
        preset = dataclasses.replace(preset, name=preset.name + "".join(f"-{k}-{v}" for k, v in changes.items()),
                                     config=dataclasses.replace(preset.config, **changes), overrides=overrides)
    if args.tensor_config:
        import hashlib
        tag = hashlib.sha256(" ".join(args.tensor_config).encode()).hexdigest()[:8]
        overrides = tuple(parse_tensor_config(t, preset.config) for t in args.tensor_config)
        preset = dataclasses.replace(preset, name=f"{preset.name}-tc{tag}", overrides=overrides + preset.overrides)
    if args.share:
        preset = dataclasses.replace(preset, name=preset.name + "-shared-" + "-".join(args.share), share=tuple(args.share))
    if args.channel_weights:
        preset = dataclasses.replace(preset, name=f"{preset.name}-cw-{args.channel_weights}", channel_weights=args.channel_weights)
    if args.independent:
        preset = dataclasses.replace(preset, name=preset.name + "-independent", sequential=False)
    if args.calib_windows:
        preset = dataclasses.replace(preset, n_calib=args.calib_windows)
    if args.finetune_steps is not None:
        preset = dataclasses.replace(preset, finetune_steps=args.finetune_steps)
    return preset


def cmd_quantize(args) -> Path:
    from .distributed import ranks
    from .quantize import quantize_model
    from .source import load_model

    preset = preset_from_args(args)
    model = load_model(args.model)
    out = Path(args.out) if args.out else default_out(preset.name)
    path = quantize_model(model, out, preset, seed=args.quant_seed, other_type=args.other_type, only=args.only,
                          calib=args.calib, device=args.device)
    if ranks().main:   # under torchrun, the others end before rank 0 has written the file
        print(describe(path))
    return path


def cmd_import_vptq(args) -> Path:
    from .import_vptq import import_checkpoint
    from vq_gguf.native.build import build, tree_dir

    build()   # the pinned converter, and the loader that checks the result
    path = import_checkpoint(args.checkpoint, args.out, llama_tree=tree_dir(), other_type=args.other_type, progress=True)
    if not args.no_load:
        check_loads(path)
    print(describe(path))
    return path


def cmd_selfgen(args) -> None:
    from .selfgen import generate
    from .source import load_model

    src = load_model(args.model)
    print(generate(src.path, Path(args.out), args.tokens, seed=args.seed))


def cmd_teacher(args) -> None:
    from .calib import DEFAULT_CALIB, calibration_tokens
    from .finetune import Teacher
    from .source import load_model

    src = load_model(args.model)
    tokens = calibration_tokens(src.path, args.calib or [DEFAULT_CALIB], args.windows + args.heldout, 512, args.seed)
    print(Teacher.run(src, tokens, args.heldout).save(Path(args.out)))


def cmd_finetune(args) -> None:
    from .finetune import finetune_file
    from .quantize import check_device, default_device

    out = Path(args.out) if args.out else Path(args.file).with_suffix(".ft.gguf")
    path = finetune_file(Path(args.file), Path(args.teacher), out, steps=args.steps, lr=args.lr, batch=args.batch,
                         device=check_device(args.device or default_device()), checkpoint=args.checkpoint, seed=args.seed,
                         eval_every=args.eval_every, row_scales=args.row_scales)
    print(describe(path))


NO_LOAD_HELP = "skip the patched llama.cpp's load checks (every tensor read, as llama.cpp does before running the file)"


def check_loads(path: Path) -> None:
    """The patched llama.cpp's load checks (format.md §6, every tensor's data too): a file it refuses is refused
    by every command with the loader's own message."""
    from vq_gguf.runtime.llama import Model
    with Model(path, n_ctx=64):
        pass


def cmd_inspect(args) -> None:
    from vq_gguf.runtime.llama import check_model_file
    path = check_model_file(args.file)
    if not args.no_load:
        check_loads(path)
    try:
        _inspect(path, args.tensor, args.decode)
    except (ValueError, KeyError, IndexError, OverflowError, MemoryError, EOFError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _inspect(path: Path, only: str | None, decode: bool) -> None:
    import numpy as np
    from gguf import GGUFReader

    from . import ggml_vq
    from .bpw import count
    from .reference import dequantize
    from .vqtensor import VQTensor

    bits = count(path)
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    version = reader.get_field(ggml_vq.FORMAT_KEY)
    print(f"format: {ggml_vq.FORMAT_KEY} = {version.contents() if version else 'absent'}")
    print(f"{'tensor':34} {'type':8} {'shape':>14} {'bpw':>7}  vq")
    for t in bits.tensors:
        if only and only not in t.name:
            continue
        extra = ""
        if ggml_vq.is_vq(by_name[t.name].tensor_type):
            q = VQTensor.from_gguf(t.name, by_name, ggml_vq.links(reader.fields))
            extra = f"v={q.v} k={2 ** q.b1}" + (f"+{2 ** q.b2}" if q.b2 else "") + (f" G={q.groups}" if q.groups > 1 else "") \
                + "".join(f" {side}->{name}" for side, name in q.shared.items())
            if decode:
                w = dequantize(q)
                extra += f"  decoded: rms {float(np.sqrt((w ** 2).mean())):.4g}, max |w| {float(np.abs(w).max()):.4g}, finite {bool(np.isfinite(w).all())}"
        print(f"{t.name:34} {t.type:8} {str(t.shape):>14} {t.bpw:7.3f}  {extra}")
    print(describe(path))


def cmd_clean(args) -> None:
    import shutil

    from .atomic import leftovers
    folders = [Path(f) for f in args.folders] or [home(), Path.cwd()]
    # the default current folder only at its top: it may be a large tree
    found = sorted({p for f in folders for p in leftovers(f, recursive=bool(args.folders) or f == home())})
    for folder in found:
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{'would remove' if args.dry_run else 'removing'} {folder} ({size / 2**20:.1f} MiB)")
        if not args.dry_run:
            shutil.rmtree(folder)
    print(f"{len(found)} leftover folder(s) under {', '.join(map(str, folders))}")


def cmd_chat(args) -> None:
    from vq_gguf.runtime.chat import run
    from vq_gguf.runtime.llama import SamplerConfig
    run(args.file, prompt=args.prompt, system=args.system, max_tokens=args.max_tokens, n_ctx=args.ctx,
        threads=args.threads, verbose=args.verbose, rpc=args.rpc,
        sampler=SamplerConfig(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed))


def cmd_serve(args) -> None:
    from vq_gguf.native.build import build
    from vq_gguf.runtime.server import run
    from vq_gguf.runtime.llama import check_model_file
    from vq_gguf.runtime.server import check_bind, check_extra
    check_model_file(args.file)   # before the build of llama-server
    check_bind(args.host, args.port, args.api_key, args.public_without_key)
    check_extra(args.llama_server_args)
    build(server=True, rpc=bool(args.rpc))  # a no-op when llama-server is built and up to date
    run(args.file, host=args.host, port=args.port, n_ctx=args.ctx, threads=args.threads, api_key=args.api_key,
        public_without_key=args.public_without_key, rpc=args.rpc, gpu_layers=args.gpu_layers, parallel=args.parallel,
        extra=args.llama_server_args)


def cmd_rpc_server(args) -> None:
    from vq_gguf.native.build import build
    from vq_gguf.runtime.rpc import check_bind, run
    check_bind(args.host, args.port, args.private_network)
    build(rpc=True)  # a no-op when rpc-server is built and up to date
    run(host=args.host, port=args.port, threads=args.threads, private_network=args.private_network)


def cmd_export(args) -> None:
    from .bundle import export
    from vq_gguf.runtime.llama import check_model_file
    if not args.no_load:
        check_loads(check_model_file(args.file))
    lib_dir = None
    if args.bundle:
        from vq_gguf.native.build import build, build_portable
        from .bundle import portable
        lib_dir = build() if args.native or not portable() else build_portable()
    out = Path(args.out) if args.out else Path(args.file).with_suffix("")
    print(export(Path(args.file), out, bundle=args.bundle, lib_dir=lib_dir, archive=args.archive,
                 results=Path(args.results) if args.results else None))


def cmd_verify(args) -> None:
    from .bundle import BundleError, verify
    try:
        manifest = verify(Path(args.path), load=None if args.no_load else check_loads)
    except BundleError as e:
        sys.exit(f"vq-gguf verify: {e}")
    loaded = "" if args.no_load else f"; {manifest['model']['file']} passes the loader's checks"
    print(f"{args.path}: all {len(manifest['files'])} files match manifest.json{loaded}")


def cmd_wheel(args) -> None:
    from vq_gguf.paths import home
    from vq_gguf.native.wheel import build_wheel, check
    libraries = None
    if not args.python_only:
        from vq_gguf.native.build import build, build_portable
        from .bundle import portable, shared_libraries
        libraries = shared_libraries(build(jobs=args.jobs) if args.native or not portable() else build_portable(jobs=args.jobs))
    wheel = build_wheel(Path(args.out) if args.out else home() / "wheels", libraries)
    print(wheel)
    if args.check:
        from vq_gguf.native.build import bin_dir
        answer = check(wheel, Path(args.check), [{"role": "user", "content": args.prompt}], max_tokens=32,
                       venv=home() / "wheel-check-venv", lib_path=bin_dir() if args.python_only else None)
        print(f"{args.check} through llama_cpp.Llama: {answer['content']!r}")


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="one prompt, answered then exit (default: interactive)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)


def parse_bool(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


def rpc_servers(text: str) -> list[str]:
    """argparse type of --rpc: HOST:PORT,... (runtime/rpc.py)."""
    from vq_gguf.runtime.rpc import parse_servers
    try:
        return parse_servers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_config(text: str, base=None):
    """'v=4,k=256,row_scale=1' -> a VQConfig (starting from `base` if given), each value of its field's type."""
    import dataclasses

    from .config import VQConfig
    types = {f.name: f.type for f in dataclasses.fields(VQConfig)}
    kw = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"unknown setting {key!r} in {text!r}; the config has {', '.join(types)}")
        kw[key] = parse_bool(value) if types[key] == "bool" else float(value) if types[key] == "float" else int(value)
    return dataclasses.replace(base, **kw) if base is not None else VQConfig(**kw)


def parse_tensor_config(text: str, base) -> tuple[str, object]:
    """'ffn_down@first,last:v=2,k=64' -> ('ffn_down@first,last', base with v=2, k=64): a Preset override."""
    from .presets import check_selector
    key, sep, settings = text.partition(":")
    if not sep or not settings:
        raise SystemExit(f"--tensor-config {text!r}: expected KIND[@WHERE,...]:SETTING=VALUE,..., e.g. "
                         "ffn_down@first,last:v=2,k=64 or ffn_up@0-10%:k=4096")
    try:
        check_selector(key)
    except ValueError as e:
        raise SystemExit(f"--tensor-config {text!r}: {e}") from None
    return key, parse_config(settings, base)


# per-tensor settings a quantize flag may override: (flag, type, help); see preset_from_args
CONFIG_FLAGS = {
    "v": (int, "vector length"),
    "k": (int, "codebook size"),
    "k_res": (int, "residual codebook size, 0 for none"),
    "groups": (int, "column groups, each with its own codebooks (vptq)"),
    "outlier_frac": (float, "share of input columns with an outlier codebook (vptq)"),
    "refit_rounds": (int, "codebook refit rounds, 0 for the paper's k-means codebooks (vptq)"),
    "col_norm": (parse_bool, "per-column scale and bias: true/false (vptq)"),
    "row_scale": (parse_bool, "per-output-channel scale: true/false (vptq)"),
}
GEOMETRY_FLAGS = ("v", "k", "k_res")  # these replace the preset's per-tensor overrides, the others apply to them


def add_quantize(p: argparse.ArgumentParser) -> None:
    from .names import LINEAR_KINDS
    from .presets import PRESETS
    p.add_argument("--preset", default="2bit", metavar="NAME",
                   help=f"one of {', '.join(PRESETS)} (vq_export/presets.toml), or of --preset-file (default: 2bit)")
    p.add_argument("--preset-file", default=None, metavar="TOML",
                   help="more presets, in presets.toml's format: selectors by position fit any model's depth")
    for name, (typ, text) in CONFIG_FLAGS.items():
        also = "; drops the preset's per-tensor overrides" if name in GEOMETRY_FLAGS else ", its per-tensor overrides included"
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=f"{text} (overrides the preset{also})")
    p.add_argument("--tensor-config", nargs="+", default=None, metavar="KIND[@WHERE,...]:SETTINGS",
                   help="other settings for some tensors, before the preset's own overrides: WHERE is first, last, a "
                        "block number (negative: from the end) or a depth range, e.g. ffn_down@first,last:v=2,k=64 "
                        "ffn_up@0-10%%:k=4096")
    p.add_argument("--share", nargs="+", default=None, metavar="KIND", choices=LINEAR_KINDS,
                   help="one main codebook for all tensors of each KIND (and equal settings), stored once "
                        "(docs/format.md 4.1): a larger codebook at the same bits")
    p.add_argument("--channel-weights", choices=("none", "fisher"), default=None,
                   help="weight of each output channel's error: fisher = mean squared gradient of the float model's "
                        "next-token loss (vq_export/fisher.py), none = all equal, the paper's loss (default: the preset's)")
    p.add_argument("--independent", action="store_true",
                   help="Hessians of every block from the float model (the reference VPTQ), not from the quantized earlier blocks")
    p.add_argument("--other-type", choices=("f32", "f16", "q8_0"), default="q8_0",
                   help="type of the tensors that are not block linears (token embedding, output)")
    p.add_argument("--quant-seed", type=int, default=0, help="seed of k-means and of the calibration windows")
    p.add_argument("--calib", nargs="+", default=None,
                   help="calibration text files or folders, or hf:DATASET[:SPLIT[:FIELD]] (default: the Austen novels shipped in the package)")
    p.add_argument("--calib-windows", type=int, default=None, help="calibration windows of 512 tokens (default: the preset's)")
    p.add_argument("--finetune-steps", type=int, default=None,
                   help="end-to-end fine-tuning steps of codebooks and norms against the float model (default: the preset's)")
    p.add_argument("--device", default=None,
                   help="torch device of the calibration, VPTQ and fine-tuning, e.g. cpu, cuda, cuda:1 (default: cuda "
                        "when torch sees a GPU, under torchrun cuda:LOCAL_RANK; else cpu)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vq-gguf")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> None:
    from vq_gguf.runtime.llama import thread_count
    ap = argparse.ArgumentParser(prog="vq-gguf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    ap.add_argument("--debug", action="store_true", help="show the Python traceback of an error, not just its message")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("build", help="build the patched llama.cpp and the runtime bindings")
    p.add_argument("--server", action="store_true", help="also llama-server")
    p.add_argument("--rpc", action="store_true", help="also the RPC backend and rpc-server (docs/rpc.md)")
    p.add_argument("--sanitize", action="store_true", help="only the sanitizer and fuzzing build (clang; docs/hardening.md)")
    p.add_argument("--cross", choices=("aarch64",), default=None,
                   help="only the kernel test for Arm, cross-compiled (run under qemu-user; docs/kernels.md)")
    p.add_argument("--portable", action="store_true", help="only the portable build of the bundle: the CPU backend "
                   "as loadable variants, for any x86-64 CPU (docs/integrations.md)")
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("quantize", help="quantize a model's block linears to VQ-GGUF")
    p.add_argument("--model", default="default", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="output GGUF (default: $VQ_GGUF_HOME/out/<model>.vq-<preset>.gguf)")
    p.add_argument("--only", nargs="+", default=None, help="quantize only tensors whose name contains one of these")
    add_quantize(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("import-vptq", help="convert a checkpoint published in microsoft/VPTQ's format to VQ-GGUF, "
                                          "exactly (docs/format.md §8) or not at all")
    p.add_argument("checkpoint", help="the checkpoint's folder (config.json with quant_method vptq, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="output GGUF")
    p.add_argument("--other-type", choices=("f32", "f16", "q8_0"), default="f16",
                   help="type of the tensors VPTQ keeps in float: embeddings, output head (default: %(default)s)")
    p.add_argument("--no-load", action="store_true", help=NO_LOAD_HELP)
    p.set_defaults(func=cmd_import_vptq)

    p = sub.add_parser("selfgen", help="calibration text sampled from the model itself (for --calib)")
    p.add_argument("--model", default="default", help="the float model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output .txt")
    p.add_argument("--tokens", type=int, default=100_000, help="tokens to write (the presets' 128 + 4 windows of 512 need 67 584)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_selfgen)

    p = sub.add_parser("teacher", help="the float model's output-norm states on calibration windows (for finetune)")
    p.add_argument("--model", default="default", help="the float model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--windows", type=int, default=320,
                   help="training windows of 512 tokens (fewer overfit: docs/results.md \"The fine-tuning teacher\")")
    p.add_argument("--heldout", type=int, default=8, help="held-out windows that choose the step kept")
    p.add_argument("--calib", nargs="+", default=None, help="calibration text (default: the Austen novels shipped in the package)")
    p.add_argument("--seed", type=int, default=1, help="seed of the window draw")
    p.set_defaults(func=cmd_teacher)

    p = sub.add_parser("finetune", help="fine-tune a VQ file's codebooks and norms end to end against a teacher")
    p.add_argument("file")
    p.add_argument("--teacher", required=True, help=".npz of `vq-gguf teacher` for FILE's float model")
    p.add_argument("--out", default=None, help="output GGUF (default: FILE with .ft.gguf)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=None, help="Adam's learning rate, cosine down to a tenth "
                                                           "(default: finetune.LR, 1e-3)")
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: in a parts folder beside --out, "
                                                      "removed when done); one of --steps steps is only written out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument("--row-scales", action="store_true", help="train a scale per output channel too (added where "
                   "FILE has none: +16 bits a row, format.md §5)")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("inspect", help="show a GGUF's tensors, VQ geometry and bits per weight")
    p.add_argument("file")
    p.add_argument("--tensor", default=None, help="only tensors whose name contains this")
    p.add_argument("--decode", action="store_true", help="decode VQ tensors with the numpy reference decoder")
    p.add_argument("--no-load", action="store_true", help=NO_LOAD_HELP)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("clean", help="remove the resume folders of interrupted quantizations and fine-tunings")
    p.add_argument("folders", nargs="*", help="where to look, with subfolders (default: $VQ_GGUF_HOME, and the current folder without them)")
    p.add_argument("--dry-run", action="store_true", help="only list them")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("chat", help="chat with a GGUF through the patched llama.cpp")
    p.add_argument("file")
    add_sampling(p)
    p.add_argument("--ctx", type=int, default=None, help="context in tokens (default: 2048, or the model's training context if smaller)")
    p.add_argument("--threads", type=thread_count, default=None)
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    p.add_argument("--rpc", type=rpc_servers, default=None, metavar="HOST:PORT,...",
                   help="run the layers on these `vq-gguf rpc-server`s (docs/rpc.md)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="serve a GGUF with the patched llama-server (OpenAI-compatible API)",
                       usage="vq-gguf serve FILE [options] [-- llama-server options]",
                       description="Options after -- go to llama-server as they are (e.g. -- --flash-attn on --temp 0.7).")
    p.add_argument("file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx", "--ctx-size", type=int, default=2048, help="context in tokens, shared by the slots")
    p.add_argument("--threads", type=thread_count, default=None)
    p.add_argument("-ngl", "--gpu-layers", type=int, default=None,
                   help="layers on the GPU of a CUDA build (llama-server's -ngl; default: its own)")
    p.add_argument("-np", "--parallel", type=int, default=None, help="requests served at once (llama-server's slots)")
    p.add_argument("--api-key", default=os.environ.get("VQ_GGUF_API_KEY"),
                   help="requests must carry 'Authorization: Bearer KEY' (default: $VQ_GGUF_API_KEY); "
                        "required beyond loopback")
    p.add_argument("--public-without-key", action="store_true",
                   help="serve beyond loopback without an API key (anyone who can reach the port may use it)")
    p.add_argument("--rpc", type=rpc_servers, default=None, metavar="HOST:PORT,...",
                   help="run the layers on these `vq-gguf rpc-server`s (docs/rpc.md)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("rpc-server", help="lend this machine's memory and cores to a model run elsewhere "
                                          "(llama.cpp's RPC backend; unauthenticated: private networks only)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--threads", type=thread_count, default=None)
    p.add_argument("--private-network", action="store_true",
                   help="bind beyond loopback: RPC has no authentication, so only on a private network")
    p.set_defaults(func=cmd_rpc_server)

    p = sub.add_parser("export", help="a folder with the GGUF, its model card and manifest; --bundle adds the "
                                      "patched libraries, llama.h and a C example")
    p.add_argument("file")
    p.add_argument("--out", default=None, help="output folder (default: FILE without .gguf)")
    p.add_argument("--bundle", action="store_true", help="add the shared libraries, headers and C example (on x86-64: "
                   "the portable build, which runs on any x86-64 CPU)")
    p.add_argument("--native", action="store_true", help="with --bundle: the libraries built for this machine's CPU "
                   "instead (quicker to build; they run only on CPUs with its instruction sets)")
    p.add_argument("--archive", action="store_true", help="also pack the folder as OUT.tar.gz")
    p.add_argument("--results", default=None, help="results.json of `vq-gguf compare` (default: any under $VQ_GGUF_HOME/compare with this file)")
    p.add_argument("--no-load", action="store_true", help=NO_LOAD_HELP)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="check an exported folder or .tar.gz against its manifest, and load its model")
    p.add_argument("path")
    p.add_argument("--no-load", action="store_true", help=NO_LOAD_HELP)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("wheel", help="build a llama-cpp-python wheel of the patched llama.cpp (on x86-64: for any CPU)")
    p.add_argument("--out", default=None, help="folder for the wheel (default: $VQ_GGUF_HOME/wheels)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--native", action="store_true",
                     help="the libraries of `vq-gguf build` (this CPU's instruction sets) instead of the portable build's")
    how.add_argument("--python-only", action="store_true",
                     help="no libraries: the package then loads those named by LLAMA_CPP_LIB_PATH, e.g. `vq-gguf build`'s")
    p.add_argument("--check", default=None, metavar="MODEL", help="install the wheel into a fresh venv and chat with MODEL")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs of the build")
    p.set_defaults(func=cmd_wheel)

    from vq_gguf.tools import compare
    p = sub.add_parser("compare", help="VQ presets against llama.cpp's k-quants and i-quants: table, plots, results.json")
    compare.add_arguments(p)
    p.set_defaults(func=compare.run)

    from . import demo
    p = sub.add_parser("demo", help="build, quantize the default model, compare it with llama.cpp's types, chat")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)   # what follows -- is llama-server's (serve only)
    args = ap.parse_args(argv[:cut])
    args.llama_server_args = argv[cut + 1:]
    if args.llama_server_args and args.cmd != "serve":
        ap.error(f"options after -- are llama-server's: only `vq-gguf serve` takes them, not `vq-gguf {args.cmd}`")
    try:
        args.func(args)
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # bad input, unwritable output, llama.cpp's refusals
        if args.debug:
            raise
        sys.exit(f"vq-gguf {args.cmd}: {e}")


if __name__ == "__main__":
    main()
