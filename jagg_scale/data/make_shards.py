"""Turn a prompt file into webdataset prompt shards for `ShardPromptStream` (`data.source: wds`).

    python -m jagg_scale.data.make_shards INPUT OUT_DIR [--format auto] [--shard-size 1000] [--prefix prompts]

Writes OUT_DIR/{prefix}-000000.tar, ... (sample = `<key>.txt` prompt + `<key>.json` metadata, see
`jagg_scale.data.shards`), then prints the brace pattern to pass as the stream's urls and the counts, and writes
the same as OUT_DIR/{prefix}.json. Bad input rows are skipped, counted and logged by the reader, exactly as when
training from the file directly (`jagg_scale.data.prompts` / `prompt_sets`).

Formats: txt (one prompt per line), jsonl (`prompt` field + metadata), and the shared-set readers pickapic,
geneval, ocr (metadata `text`), parti, drawbench. `auto` goes by extension only: .txt -> txt, .jsonl -> jsonl,
.tsv -> parti, .csv -> drawbench; name ocr/pickapic explicitly (an OCR file is a .txt whose metadata matters).
Use a shard size that gives at least world_size x num_workers shards.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path


from .prompt_sets import read_drawbench, read_geneval, read_ocr, read_parti, read_pickapic
from .prompts import LineReader, PromptRecord, PromptSet, parse_jsonl_record
from .shards import shard_pattern, write_prompt_shards


def _read_lines(parse):
    def read(path) -> PromptSet:
        r = LineReader(path)
        r.read_lines(parse)
        return r.finish()
    return read


READERS = {
    "txt": _read_lines(lambda text: PromptRecord(text, {})),
    "jsonl": _read_lines(parse_jsonl_record),
    "pickapic": read_pickapic,
    "geneval": read_geneval,
    "ocr": read_ocr,
    "parti": read_parti,
    "drawbench": read_drawbench,
}
AUTO = {".txt": "txt", ".jsonl": "jsonl", ".tsv": "parti", ".csv": "drawbench"}


def resolve_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix.lower() not in AUTO:
        raise ValueError(f"--format auto: cannot tell the format of {path} from its extension; "
                         f"pass one of {sorted(READERS)}")
    return AUTO[path.suffix.lower()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m jagg_scale.data.make_shards", description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--format", default="auto", choices=["auto", *READERS])
    ap.add_argument("--shard-size", type=int, default=1000, help="records per shard (default 1000)")
    ap.add_argument("--prefix", default="prompts")
    ap.add_argument("--overwrite", action="store_true", help="replace existing {prefix}-NNNNNN.tar in OUT_DIR")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    if not args.input.is_file():
        ap.error(f"{args.input}: no such file")
    try:
        fmt = resolve_format(args.input, args.format)
    except ValueError as err:
        ap.error(str(err))
    prompts = READERS[fmt](args.input)
    paths = write_prompt_shards(prompts.records, args.out_dir, args.shard_size, args.prefix, overwrite=args.overwrite)
    summary = {
        "pattern": shard_pattern(args.out_dir, args.prefix, len(paths)),
        "shards": len(paths),
        "written": len(prompts.records),
        "skipped": prompts.skipped,
        "input": str(args.input),
        "format": fmt,
        "shard_size": args.shard_size,
    }
    (args.out_dir / f"{args.prefix}.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(summary["pattern"])
    print(f"written {summary['written']} records in {len(paths)} shards, skipped {summary['skipped']} bad input rows")
    return summary


if __name__ == "__main__":
    main()
