"""The options commands share (`estimate` and `gen-config`; `cache`, `sample` and `encode-prompts`): one name,
one meaning, one list of choices (from the config modules), one default. Pure: no torch import.
"""

from __future__ import annotations

import functools

import click
from click.core import ParameterSource

from fluxzero import plan as memory
from fluxzero.config.ema import EMA_DEVICES, EMA_DTYPES, EmaConfig
from fluxzero.config.lora import ADAPTER_TYPES, DEFAULT_TARGETS, TARGET_PRESETS, LoraConfig
from fluxzero.data.encode import T5_MAX_TOKENS

POS = click.IntRange(min=1)
DIR = click.Path(file_okay=False, path_type=str)
NONNEG = click.IntRange(min=0)


class Finite(click.FloatRange):
    """A FloatRange that refuses nan and inf: click's bounds let nan through (every comparison with nan is
    false), and `--margin nan` or `--gpu-memory inf` then printed FITS."""

    def __init__(self, *args, example: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.example = example

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if v != v or v in (float("inf"), float("-inf")):
            self.fail(f"{value!r} is not a finite number; give {self.example}.", param, ctx)
        return v


GIB = Finite(min=0, min_open=True, example="a size in GiB such as 80")
FRACTION = Finite(0, 1, max_open=True, example="a fraction in [0, 1) such as 0.1")


def parse_resolution(value: str) -> tuple[int, int]:
    """'512' -> (512, 512); '1024x768' -> (1024, 768) as (height, width). Raises ValueError."""
    parts = value.lower().replace("*", "x").split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"resolution must look like 512 or 1024x768, got {value!r}")
    h, w = (int(parts[0]), int(parts[-1]))
    memory.image_tokens(h, w)
    return h, w


def _resolution(ctx, param, value):
    try:
        return parse_resolution(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def parse_lora_targets(value: str):
    """A preset name (a word: a misspelt one is refused as such) or comma-separated module-name patterns."""
    if value in TARGET_PRESETS or not any(c in value for c in ".*?[,"):
        return value
    return tuple(t.strip() for t in value.split(",") if t.strip())


def gpu_memory_from(gpu: str | None, gpu_memory: float | None, base_quant: str | None = None) -> float | None:
    """The GPU memory --gpu NAME or --gpu-memory gives; a UsageError for both, or for a --gpu that cannot train
    `base_quant` (fp8-matmul needs FP8 tensor cores)."""
    if gpu is not None and gpu_memory is not None:
        raise click.UsageError("give the GPU memory one way only: --gpu NAME or --gpu-memory GIB")
    problem = memory.gpu_quant_problem(gpu, base_quant)
    if problem:
        raise click.UsageError(problem)
    return memory.GPU_MEMORY_GIB[gpu] if gpu is not None else gpu_memory


def topology_from(hostfile, nodes, gpus_per_node) -> tuple[int, int]:
    """(nodes, GPUs per node) from a hostfile (largest slot count per node) or the two options."""
    if hostfile is not None:
        if nodes is not None or gpus_per_node is not None:
            raise click.UsageError("give the topology one way only: --hostfile or --nodes/--gpus-per-node")
        from fluxzero.cluster.hostfile import HostfileError, parse_hostfile

        try:
            hosts = parse_hostfile(hostfile)
        except HostfileError as e:
            raise click.BadParameter(str(e), param_hint="--hostfile") from None
        if len(set(hosts.values())) > 1:
            # ZeRO partitions over every rank: modelling max slots x hosts would over-count the world (and
            # under-count per-GPU memory); one node of all the ranks keeps the partitions right and bounds the
            # host memory per node from above
            total = sum(hosts.values())
            click.echo(
                f"warning: {hostfile} has uneven slots {dict(hosts)}: modelled as one node of {total} "
                f"ranks (per-GPU figures exact, host memory per node an upper bound)",
                err=True,
            )
            return 1, total
        return len(hosts), max(hosts.values())
    return nodes or 1, gpus_per_node or 1


# ---------------------------------------------------------------------------------------------------------
# Shared options. `when` prefixes the help of an option that only one mode of a command reads ("--fit: ").
# ---------------------------------------------------------------------------------------------------------
def topology(fn):
    """--hostfile, --nodes, --gpus-per-node: where the run's GPUs are (topology_from reads them)."""
    for decorator in reversed(
        [
            click.option(
                "--hostfile",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="DeepSpeed hostfile ('host slots=N' lines): nodes = hosts, GPUs per node = largest slot "
                "count (world size = sum of slots).",
            ),
            click.option(
                "--nodes", type=POS, default=None, help="Number of nodes (world size = nodes x GPUs per node)."
            ),
            click.option("--gpus-per-node", type=POS, default=None, help="GPUs per node."),
        ]
    ):
        fn = decorator(fn)
    return fn


def host_memory(when: str = ""):
    return click.option(
        "--host-memory",
        type=GIB,
        default=None,
        help=f"{when}Host memory per node in GiB (offload must fit it); without it the host is not "
        f"checked, the need is printed, and a need beyond common machines' is the last line.",
    )


def gpu(when: str = ""):
    return click.option(
        "--gpu",
        type=click.Choice(list(memory.GPU_MEMORY_GIB)),
        default=None,
        help=f"{when}GPU model, for its memory (h200 = 139.8 GiB as torch reports it).",
    )


def gpu_memory(when: str = "", then: str = "."):
    return click.option(
        "--gpu-memory", type=GIB, default=None, help=f"{when}GPU memory in GiB (instead of --gpu){then}"
    )


def resolution(when: str = ""):
    return click.option(
        "--resolution",
        default="512",
        show_default=True,
        callback=_resolution,
        help=f"{when}Image size in pixels: 512 or HEIGHTxWIDTH (tokens = H/16 x W/16).",
    )


def txt_len(when: str = ""):
    return click.option("--txt-len", type=POS, default=512, show_default=True, help=f"{when}T5 text tokens per sample.")


def margin(when: str = ""):
    return click.option(
        "--margin",
        type=FRACTION,
        default=0.10,
        show_default=True,
        help=f"{when}Safety margin: fits when the need is at most (1 - margin) x the GPU and host memory.",
    )


def lora_targets(when: str = ""):
    return click.option(
        "--lora-targets",
        default=DEFAULT_TARGETS,
        show_default=True,
        help=f"{when}LoRA targets (the run file's lora.targets): a preset ("
        + ", ".join(TARGET_PRESETS)
        + ") or comma-separated module-name patterns.",
    )


# The adapter beside --lora-rank, named as the run file's lora section names it
ADAPTER_OPTIONS = [
    click.option(
        "--lora-type",
        type=click.Choice(list(ADAPTER_TYPES)),
        default="lora",
        show_default=True,
        help="With --lora-rank: the run file's lora.type (dora adds a magnitude per output row, lokr trains "
        "Kronecker factors: each counted as PEFT builds it).",
    ),
    click.option(
        "--lora-factor",
        type=click.IntRange(min=-1),
        default=-1,
        show_default=True,
        help="With --lora-type lokr: the run file's lora.factor (-1: the divisors nearest the square root).",
    ),
    click.option(
        "--lora-decompose-both",
        is_flag=True,
        default=False,
        help="With --lora-type lokr: the run file's lora.decompose_both (w1 low-rank too).",
    ),
]
ADAPTER_KEYS = ("lora_type", "lora_factor", "lora_decompose_both")


def lora_section(values: dict, base_quant: str = "none") -> LoraConfig | None:
    """The run file's `lora:` section that --lora-rank, --lora-targets, --lora-dropout (where the command has it)
    and ADAPTER_OPTIONS describe, with `base_quant` (--fit's "auto" as none); None for rank 0. A UsageError for
    adapter options or a quantized base without a rank; ValueError (naming the lora.KEY) for a section the
    trainer refuses."""
    if not values["lora_rank"]:
        if values["lora_type"] != "lora" or values["lora_factor"] != -1 or values["lora_decompose_both"]:
            raise click.UsageError(
                "--lora-type, --lora-factor and --lora-decompose-both describe adapters: give --lora-rank too"
            )
        if base_quant not in ("none", "auto"):
            raise click.UsageError(f"--base-quant {base_quant} quantizes the frozen base of a LoRA: add --lora-rank")
        return None
    return LoraConfig(
        rank=values["lora_rank"],
        targets=parse_lora_targets(values["lora_targets"]),
        dropout=values.get("lora_dropout", 0.0),
        type=values["lora_type"],
        factor=values["lora_factor"],
        decompose_both=values["lora_decompose_both"],
        base_quant="none" if base_quant == "auto" else base_quant,
    )


def ema_section(dtype: str, device: str) -> EmaConfig | None:
    """The run file's `ema:` section that --ema and --ema-device describe (None for --ema none)."""
    return None if dtype == "none" else EmaConfig(dtype=dtype, device=device)


def ema(dest: str = "ema", when: str = ""):
    return click.option(
        "--ema",
        dest,
        type=click.Choice(["none", *EMA_DTYPES]),
        default="none",
        show_default=True,
        help=f"{when}EMA of the trained weights in this dtype (the run file's ema: section), "
        f"partitioned like the optimizer states under ZeRO 1-3.",
    )


def ema_device(dest: str = "ema_device", when: str = ""):
    return click.option(
        "--ema-device",
        dest,
        type=click.Choice(EMA_DEVICES),
        default="gpu",
        show_default=True,
        help=f"{when}Where the EMA lives (ema.device).",
    )


def encoders(t5_length_help: str):
    """--flux-dir and the folders that override its parts (--vae, --t5, --clip, --t5-tokenizer, --clip-tokenizer),
    then --t5-max-length with `t5_length_help` (what the length is of, and its default, differ per command)."""
    folders = [
        click.option(
            "--flux-dir",
            type=DIR,
            default=None,
            help="Local FLUX.1 diffusers folder: vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), tokenizer/, "
            "tokenizer_2/.",
        ),
        click.option("--vae", type=DIR, default=None, help="diffusers AutoencoderKL folder (overrides FLUX_DIR/vae)."),
        click.option(
            "--t5",
            type=DIR,
            default=None,
            help="transformers T5EncoderModel folder (overrides FLUX_DIR/text_encoder_2).",
        ),
        click.option(
            "--clip",
            type=DIR,
            default=None,
            help="transformers CLIPTextModel folder (overrides FLUX_DIR/text_encoder).",
        ),
        click.option(
            "--t5-tokenizer", type=DIR, default=None, help="T5 tokenizer folder (overrides FLUX_DIR/tokenizer_2)."
        ),
        click.option(
            "--clip-tokenizer", type=DIR, default=None, help="CLIP tokenizer folder (overrides FLUX_DIR/tokenizer)."
        ),
        click.option("--t5-max-length", type=click.IntRange(1, T5_MAX_TOKENS), default=None, help=t5_length_help),
    ]

    def decorate(fn):
        for decorator in reversed(folders):
            fn = decorator(fn)
        return fn

    return decorate


def renamed(old: str, new: str, dest: str, type_=None, note: str = ""):
    """Keep `old` as a hidden alias of the option `new` (stored in `dest`): its value is used when `new` is not
    given, with one sentence on stderr naming the new spelling. Put it above the command's other decorators."""
    alias = f"_{dest}_alias"

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            value = kwargs.pop(alias)
            if value is not None:
                ctx = click.get_current_context()
                if ctx.get_parameter_source(dest) == ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{old} is the old name of {new}: give {new} only")
                click.echo(f"note: {old} is now {new}{note}; the old name still works.", err=True)
                kwargs[dest] = value
            return fn(*args, **kwargs)

        return click.option(old, alias, type=type_, default=None, hidden=True, expose_value=True)(wrapper)

    return decorate
