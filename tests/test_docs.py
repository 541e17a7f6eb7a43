"""The documents hold together: every relative link and anchor resolves, every manual in docs/ is
reachable from the README, and the README's command table lists every command the CLI has."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "BENCHMARKS.md",
                    *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks: a link or heading in code is not one."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path):
    """(line number, target) of every link in a document that is not to another site."""
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("``", line)):  # not links shown as code
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                yield number, target


def test_the_anchor_rule_matches_github():
    assert github_anchor("Parallelism: tensor x pipeline x data (x context)") == \
        "parallelism-tensor-x-pipeline-x-data-x-context"
    assert github_anchor("Speed levers against `transformers`") == \
        "speed-levers-against-transformers"
    assert github_anchor("muP: learning-rate transfer across widths") == \
        "mup-learning-rate-transfer-across-widths"


def broken_links(document: Path) -> list[str]:
    """`line: target: why` for each relative link whose file or heading does not exist."""
    broken = []
    for number, target in relative_links(document):
        path, _, anchor = target.partition("#")
        destination = (document.parent / path).resolve() if path else document
        where = f"{document.name}:{number}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no such file")
        elif anchor and destination.suffix != ".md":
            broken.append(f"{where}: an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(destination):
            broken.append(f"{where}: no heading with that anchor in {destination.name}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(document):
    broken = broken_links(document)
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: with `code` (and more)\n"
                                       "```\n# a comment in a code block, not a heading\n```\n")
    (tmp_path / "picture.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-section-with-code-and-more) [ok](#page)\n"
                    "![ok](picture.png) [web](https://example.com/x.md)\n"
                    "[gone](missing.md) "
                    "[no heading](other.md#a-comment-in-a-code-block-not-a-heading)\n"
                    "[self](#nowhere) [png](picture.png#top)\n"
                    "`[shown as code](missing.md)`\n```\n[in a code block](missing.md)\n```\n")
    assert broken_links(page) == [
        "page.md:5: missing.md: no such file",
        "page.md:5: other.md#a-comment-in-a-code-block-not-a-heading: no heading with that "
        "anchor in other.md",
        "page.md:6: #nowhere: no heading with that anchor in page.md",
        "page.md:6: picture.png#top: an anchor into a file that is not markdown"]


def test_every_manual_in_docs_is_linked_from_the_readme():
    readme_targets = {target.partition("#")[0] for _, target in relative_links(REPO / "README.md")}
    manuals = {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")}
    assert manuals, "docs/ holds no manual"
    assert not manuals - readme_targets, \
        f"not linked from README.md: {sorted(manuals - readme_targets)}"


def test_the_readme_command_table_lists_every_command():
    from pretrain.cli import build_parser

    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    readme = (REPO / "README.md").read_text()
    missing = [name for name in subparsers.choices if f"| `pretrain {name}" not in readme]
    assert not missing, f"commands missing from the README's command table: {missing}"


# ---- facts the documents state, read from the code that decides them --------------------------

def _first_screen(text: str) -> list[str]:
    """The README's lines down to the end of the two commands' code block."""
    lines = text.splitlines()
    heading = lines.index("## The two commands")
    end = next(i for i in range(heading + 1, len(lines)) if lines[i] == "```"
               and any(lines[j].startswith("```bash") for j in range(heading, i)))
    return lines[:end + 1]


def test_the_readme_first_screen_says_what_for_whom_why_and_where_it_stands():
    """At most 40 lines: what it is, who it is for, why it over the alternatives, that the GPU
    numbers are predictions (with the planner's error against the published runs, computed
    here), where to start with one's own data, and the two commands."""
    from pretrain.plan.published import BLOOM_176B, MEGATRON_70B
    from pretrain.plan.search import estimate

    screen = _first_screen((REPO / "README.md").read_text())
    assert len(screen) <= 40, f"the first screen is {len(screen)} lines"
    text = " ".join(" ".join(screen).split())
    for phrase in ("Who it is for", "Megatron-LM, torchtitan or GPT-NeoX", "resumes on any layout",
                   "`pretrain plan`", "lm-eval", "Nothing has run on a GPU",
                   "planner's prediction", "(docs/verified.md)", "(docs/first-run.md)",
                   "bash launch/quickstart.sh", "bash launch/test.sh"):
        assert phrase in text, phrase
    megatron = estimate(MEGATRON_70B["model"], MEGATRON_70B["layout"], MEGATRON_70B["cluster"],
                        ds=MEGATRON_70B["ds"])
    bloom = estimate(BLOOM_176B["model"], BLOOM_176B["layout"], BLOOM_176B["cluster"],
                     ds=BLOOM_176B["ds"])
    m_ratio = megatron.model_tflops_per_gpu / MEGATRON_70B["published_tflops"]
    b_ratio = bloom.hardware_tflops_per_gpu / BLOOM_176B["published_hw_tflops"]
    def error(ratio: float) -> str:  # "14% under", "2% over"
        return f"{100 * abs(ratio - 1):.0f}% {'over' if ratio > 1 else 'under'}"

    assert (f"predicts {megatron.model_tflops_per_gpu:.0f} TFLOP/s per GPU for Megatron-Core's "
            f"70B on 768 H100 (published ~{MEGATRON_70B['published_tflops']:.0f}: "
            f"{error(m_ratio)})") in text
    assert (f"and {bloom.hardware_tflops_per_gpu:.0f} for BLOOM-176B on 384 A100 (published "
            f"~{BLOOM_176B['published_hw_tflops']:.0f}: {error(b_ratio)})") in text


RECIPE_ROW = re.compile(r"^\| `configs/(\w+)\.yaml` \| (\d+) x 8 H100 \|.*\| ([\d,]+) \| "
                        r"([\d.]+)%[^|]*\| ([\d.]+) GB \|(?: ([\d,]+) \(([\d.]+)x\) \|)?$", re.M)


@pytest.mark.parametrize("document", ["README.md", "docs/launching.md"])
def test_the_recipe_tables_print_what_plan_predicts(document):
    """Each recipe row's tokens/s, MFU and memory per GPU are what `pretrain plan --config
    <recipe> --world-size <GPUs>` prints (the planner on the recipe's cluster)."""
    from pretrain.config import load_config
    from pretrain.plan.clusters import make_cluster
    from pretrain.plan.dry_run import dry_run, settle_for_plan
    from pretrain.plan.memory import GB
    from pretrain.plan.search import estimate

    rows = RECIPE_ROW.findall((REPO / document).read_text())
    assert {row[0] for row in rows} == {"llama_7b", "llama_13b", "llama_70b", "mixtral_8x7b",
                                        "qwen3_8b", "qwen3_30b_a3b"}
    def planned(recipe: str, cluster, *overrides: str):
        settled = settle_for_plan(load_config(REPO / "configs" / f"{recipe}.yaml", overrides),
                                  on_this_machine=False)
        run = dry_run(settled, world_size=cluster.world_size, accelerator="cuda")
        return estimate(run.cfg.model, run.layout, cluster, engine=run.cfg.train.engine)

    for recipe, nodes, tokens, mfu, memory, fp8_tokens, fp8_ratio in rows:
        cluster = make_cluster("h100-80gb", nodes=int(nodes))
        plan = planned(recipe, cluster)
        assert (tokens, mfu, memory) == (f"{plan.tokens_per_s:,.0f}", f"{100 * plan.mfu:.1f}",
                                         f"{plan.memory.total / GB:.1f}"), recipe
        # the README's FP8 column: the same command with --set train.fp8=tensorwise
        assert bool(fp8_tokens) == (document == "README.md"), recipe
        if fp8_tokens:
            fp8 = planned(recipe, cluster, "train.fp8=tensorwise")
            assert (fp8_tokens, fp8_ratio) == (
                f"{fp8.tokens_per_s:,.0f}", f"{fp8.tokens_per_s / plan.tokens_per_s:.2f}"), recipe


def _recipe_summary(name: str) -> str:
    """`7b: TP 2, ZeRO-3` of configs/llama_<name>.yaml (with `x PP n` for a pipeline)."""
    from pretrain.config import load_config
    from pretrain.resolve.ds_config import load_ds_json

    cfg = load_config(REPO / "configs" / f"llama_{name}.yaml")
    stage = load_ds_json(cfg.deepspeed)["zero_optimization"]["stage"]
    pipeline = f" x PP {cfg.parallel.pipeline}" if cfg.parallel.pipeline > 1 else ""
    return f"{name}: TP {cfg.parallel.tensor}{pipeline}, ZeRO-{stage}"


def test_the_configs_page_states_each_recipes_layout_as_its_config_does():
    text = " ".join((REPO / "docs" / "configs.md").read_text().split())
    for name in ("125m", "1b", "7b", "13b", "70b"):
        assert _recipe_summary(name) in text, _recipe_summary(name)


def test_each_recipe_is_submitted_with_its_own_slurm_script():
    """The README names `slurm/pretrain_<size>.sh` for each recipe that has one; `CONFIG=` on
    another script only for a recipe without its own (Mixtral). Each script's body is the 70B
    one's (what tests/test_slurm.py runs), its #SBATCH header and CONFIG aside."""
    readme = " ".join((REPO / "README.md").read_text().split())
    scripts = sorted((REPO / "slurm").glob("pretrain_*.sh"))
    assert len(scripts) >= 3
    for script in scripts:
        assert f"sbatch slurm/{script.name}" in readme, script.name
        recipe = re.search(r'CONFIG="\$\{CONFIG:-(configs/\w+\.yaml)\}"', script.read_text())[1]
        assert f"CONFIG={recipe}" not in readme, f"{recipe} has its own script, {script.name}"

    def body(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines()
                if line and not line.startswith("#") and not line.startswith("CONFIG=")]

    for script in scripts:
        assert body(script) == body(REPO / "slurm" / "pretrain_70b.sh"), script.name


def _unbracketed_options(usage: str) -> list[str]:
    """The `--options` of a usage line outside every [...] (nested brackets included)."""
    depth, kept = 0, []
    for char in usage:
        depth += char == "["
        if depth == 0:
            kept.append(char)
        depth -= char == "]"
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", "".join(kept))


def test_the_readme_command_table_brackets_exactly_the_optional_options():
    """An option the table shows outside brackets is one argparse requires (`plan --world-size`
    has a default: it is bracketed)."""
    from pretrain.cli import build_parser

    parsers = next(action for action in build_parser()._actions
                   if isinstance(action, argparse._SubParsersAction)).choices
    readme = (REPO / "README.md").read_text()
    wrong = []
    for name, usage in re.findall(r"^\| `pretrain ([\w-]+)( [^`]*)?` \|", readme, re.M):
        subparsers = [a for a in parsers[name]._actions
                      if isinstance(a, argparse._SubParsersAction)]
        if subparsers:  # `launch k8s ...`: the subcommand's own parser
            sub, _, usage = usage.strip().partition(" ")
            if sub not in subparsers[0].choices:
                continue
            parser = subparsers[0].choices[sub]
        else:
            parser = parsers[name]
        required = {s for a in parser._actions if a.required for s in a.option_strings}
        wrong += [f"pretrain {name}: {option} is optional" for option in
                  _unbracketed_options(usage.replace("\\|", "|")) if option not in required]
    assert not wrong, "\n".join(wrong)
