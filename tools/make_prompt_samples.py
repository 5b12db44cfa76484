"""Rebuild data/prompts/: small, licensed samples of the public prompt sets, committed so that the prompt-set
readers are tested in any clone (the full sets are optional: `jagg_scale.data.shared_prompts_dir()`).

    python -m tools.make_prompt_samples [--shared DIR] [--out data/prompts]

Each sample keeps the source file's own bytes: its header, its first lines (Pick-a-Pic: its first captions that pass
a broad word filter, `AVOID`), a few chosen rows the tests read (PartiPrompts' quoted "Dogs playing poker" rows)
and whether its last line ends in a newline. Only sets whose
licence allows redistribution are sampled, each with its LICENSE beside it: flow_grpo (MIT), geneval (MIT),
PartiPrompts (Apache-2.0). DrawBench's licence is unknown, so its format is covered by a file written for this
repository (drawbench_format/example.csv, kept as it is). MANIFEST.md lists every file with its size, line count
and hash, in the layout of the full sets' manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
from pathlib import Path

from jagg_scale.data import shared_prompts_dir

ROOT = Path(__file__).resolve().parents[1]

# Pick-a-Pic captions are what users typed, some of it explicit: its samples keep only the captions that pass this
# deliberately broad word filter (people, bodies, violence, real people's names), not simply the first lines
AVOID_WORDS = (
    r"girls? wom[ae]n m[ae]n boys? lad(y|ies) wife husband couple person people child\w* baby young old face portrait "
    r"selfie asian latina body bodies skin sexy hot nude nud\w* naked naturist bikini lingerie underw\w* skirt "
    r"miniskirt shorts singlet leather outfits? breasts? boobs? naturals panties seductive erotic fetish porn nsfw "
    r"bdsm dildo bed kiss\w* date ugly beautiful attractive pretty blood gore dead death kill\w* bomb guns? war army "
    r"soldiers? wrestl\w* scream ghostface jesus pope god demons? hell baphomet witch schoolgirl schoolteacher "
    r"swift hanks jordan lee peron trump cruise chirac"
).split()
AVOID = re.compile(r"\b(" + "|".join(AVOID_WORDS) + r")\b", re.IGNORECASE)


def benign(count: int):
    """The 1-based numbers of the first `count` lines that AVOID does not match."""
    return lambda lines: [i for i, line in enumerate(lines, start=1)
                          if not AVOID.search(line.decode("utf-8", "replace"))][:count]


# file -> the 1-based line numbers kept (a header is line 1), or a function of the file's lines giving them
SAMPLES = {
    "flow_grpo/dataset/pickscore/train.txt": benign(40),
    "flow_grpo/dataset/pickscore/test.txt": benign(30),
    "flow_grpo/dataset/geneval/test_metadata.jsonl": range(1, 31),
    "flow_grpo/dataset/ocr/test.txt": range(1, 31),
    "geneval_official/prompts/evaluation_metadata.jsonl": range(1, 21),
    "parti/PartiPrompts.tsv": [*range(1, 26), 751, 752],
}
LICENSES = {
    "flow_grpo": ("github.com/yifan123/flow_grpo @ ac4c86e8cae021841f1fde853d340e0db67690dd", "MIT"),
    "geneval_official": ("github.com/djghosh13/geneval @ af4902f24d3ca90ebbb446dd9891a59e0f82725f", "MIT"),
    "parti": ("github.com/google-research/parti @ 5a657978134374ce28973948331b319adef164bd", "Apache-2.0"),
}
OWN = ["drawbench_format/example.csv"]  # written for this repository


def sample(src: Path, keep) -> bytes:
    """The kept lines of `src`, byte for byte; no final newline when the source's last line has none and the
    sample ends with it, else every line keeps its own ending."""
    lines = src.read_bytes().splitlines(keepends=True)
    out = b"".join(lines[i - 1] for i in (keep(lines) if callable(keep) else keep))
    if not src.read_bytes().endswith(b"\n"):
        out = out.rstrip(b"\n")  # the source's last line has no newline: neither has the sample's
    return out


def manifest(out: Path) -> str:
    rows = []
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.md"):
        data = path.read_bytes()
        newlines = data.count(b"\n")
        rows.append(f"| {path.relative_to(out).as_posix()} | {len(data)} | {newlines} | "
                    f"{hashlib.sha256(data).hexdigest()[:16]} |")
    sources = "\n".join(f"- {name}/ : {where}; LICENSE: {licence} (copied beside the sample)"
                        for name, (where, licence) in LICENSES.items())
    return (
        "# Prompt-set samples (tools/make_prompt_samples.py)\n\n"
        "Small samples of the public prompt sets the readers in `jagg_scale/data/prompt_sets.py` parse, so that their\n"
        "tests run in any clone. Each sample is the start of the source file (plus the rows listed in the tool;\n"
        "Pick-a-Pic: its first captions that pass the tool's word filter, since the set holds users' prompts, some\n"
        "explicit), byte for byte, under the source's own licence:\n\n"
        f"{sources}\n"
        "- drawbench_format/ : written for this repository (Apache-2.0, as the project) in DrawBench's CSV layout\n"
        "  (header `Prompts,Category`, quoted fields with commas); DrawBench's own licence is unknown, so none of\n"
        "  its prompts are here.\n\n"
        "The full sets are optional (`jagg_scale.data.shared_prompts_dir()`; "
        "tests/data/test_prompt_sets.py runs on them\n"
        "too when they are present).\n\n"
        "| file | bytes | lines (wc -l) | sha256[:16] |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared", type=Path, default=shared_prompts_dir(), help="the full prompt sets")
    p.add_argument("--out", type=Path, default=ROOT / "data" / "prompts")
    args = p.parse_args(argv)
    if not args.shared.is_dir():
        print(f"make_prompt_samples: the full prompt sets are not at {args.shared} (--shared DIR)", file=sys.stderr)
        return 2
    for rel, keep in SAMPLES.items():
        dest = args.out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(sample(args.shared / rel, keep))
    for name in LICENSES:
        shutil.copyfile(args.shared / name / "LICENSE", args.out / name / "LICENSE")
    for rel in OWN:
        if not (args.out / rel).is_file():
            print(f"make_prompt_samples: {args.out / rel} (written for this repository) is missing", file=sys.stderr)
            return 2
    (args.out / "MANIFEST.md").write_text(manifest(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
