"""The config reference: every key of every config group option, with its default as composed and its meaning,
read from the yaml's own comments, the one source (`docs/config.md` and `topp-rl train --help` print that text).

A key's comment is its trailing `# ...` and the comment lines just above it (same indentation, no blank line
between); the comment block that opens a file describes the option. A key whose value is one interpolation
(`${rollout.top_p}`) follows that key and needs no comment of its own; a key without a comment in one option takes
the same key's comment from another (a derived option, `algo=cispo` over grpo, or another option of the group).
Hydra's own `_target_` / `_partial_` / `_recursive_` show as the node's builder, not as keys.

    python -m topp_rl.config_reference            # writes docs/config.md
    python -m topp_rl.config_reference --check    # exit 1 naming the keys without a comment, or a stale page
"""

import argparse
import functools
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from topp_rl.paths import CHECKOUT_ROOT, config_dir

INSTANTIATE_KEYS = ("_target_", "_partial_", "_recursive_")
# Sub-groups documented as groups of their own; Hydra's own groups (hydra/help, hydra/job_logging) are Hydra's.
GROUPS = ("algo", "rollout", "rollout/step", "model", "task", "trainer", "logger", "callbacks", "parallel",
          "experiment", "teacher")
_FOLLOWER = re.compile(r"\$\{([\w.]+)\}")
PAGE = Path("docs/config.md")


@dataclass
class Key:
    """One key of one option: `path` dotted as typed on the command line, `doc` its comment ("" when none)."""

    path: str
    doc: str
    node: bool = False  # a mapping with keys below it: a row only when it is built (`_target_`) or commented
    follows: str | None = None  # the key its value is, when the value is one interpolation (`${rollout.top_p}`)


@dataclass
class Option:
    group: str
    name: str
    doc: str  # the file's opening comment
    global_package: bool = False  # `# @package _global_`: it may set other groups' keys, its comments say why
    keys: dict[str, Key] = field(default_factory=dict)
    selects: list[str] = field(default_factory=list)  # `override /group: option` of its defaults
    sets: list[str] = field(default_factory=list)  # keys of other groups it sets (`@package _global_`)


# ----- reading comments -----


def _comment(text: str) -> str:
    """The comment of a line's tail (after its key / value): "" when it has none."""
    return text.split("#", 1)[1].strip() if "#" in text else ""


def _comment_above(lines: list[str], line: int, column: int) -> tuple[str, bool]:
    """The comment lines right above `line` at `column`, and whether they open the file (the option's doc)."""
    found = []
    i = line - 1
    while i >= 0 and lines[i].strip().startswith("#") and len(lines[i]) - len(lines[i].lstrip()) == column:
        if lines[i].strip().startswith("# @package"):
            break
        found.append(lines[i].strip()[1:].strip())
        i -= 1
    opens_file = all(not lines[j].strip() or lines[j].strip().startswith("# @package") for j in range(i + 1))
    return " ".join(reversed(found)), opens_file


def _key_comment(lines: list[str], key: yaml.Node, value: yaml.Node) -> tuple[str, bool]:
    above, opens_file = _comment_above(lines, key.start_mark.line, key.start_mark.column)
    inline = isinstance(value, yaml.ScalarNode) and value.style not in ("|", ">")
    if inline or getattr(value, "flow_style", False):  # the tail after the value (a flow list may span lines)
        tail = _comment(lines[value.end_mark.line][value.end_mark.column:])
    else:  # a block node: the tail of the key's own line
        tail = _comment(lines[key.end_mark.line][key.end_mark.column:])
    if opens_file:
        above = ""
    # The key's own line first: the lines above may speak for the keys that follow too.
    return ". ".join(part for part in (tail, above) if part), opens_file


def _file_doc(lines: list[str]) -> str:
    """The comment block that opens a file (after `# @package`), one line."""
    out = []
    for line in lines:
        text = line.strip()
        if text.startswith("# @package"):
            continue
        if not text.startswith("#"):
            break
        out.append(text[1:].strip())
    return " ".join(out)


def _walk(lines: list[str], mapping: yaml.MappingNode, prefix: str, out: dict[str, Key], *, root: bool) -> None:
    for key, value in mapping.value:
        name = key.value
        if root and name == "defaults" or name in INSTANTIATE_KEYS:
            continue
        path = f"{prefix}{name}"
        doc, _ = _key_comment(lines, key, value)
        if isinstance(value, yaml.MappingNode) and not value.flow_style:
            has_keys = any(k.value not in INSTANTIATE_KEYS for k, _ in value.value)
            out[path] = Key(path, doc, node=has_keys)
            _walk(lines, value, f"{path}.", out, root=False)
        else:
            followed = _FOLLOWER.fullmatch(value.value) if isinstance(value, yaml.ScalarNode) else None
            out[path] = Key(path, doc, follows=followed.group(1) if followed else None)


def _package_prefix(text: str, prefix: str) -> str:
    return "" if text.startswith("# @package _global_") else prefix


def _read_option(path: Path, prefix: str, keys: dict[str, Key], selects: list[str]) -> str:
    """Add the keys `path` defines (its base options' first, then its own) to `keys`; return the file's doc."""
    text = path.read_text()
    lines = text.splitlines()
    data = yaml.compose(text)
    prefix = _package_prefix(text, prefix)
    for entry in (yaml.safe_load(text) or {}).get("defaults", []) if isinstance(data, yaml.MappingNode) else []:
        if isinstance(entry, str) and entry != "_self_" and not entry.startswith("/"):  # a base option: grpo
            base = entry.removesuffix("@_here_")
            _read_option(path.parent / f"{base}.yaml", prefix, keys, [])
        elif isinstance(entry, dict):
            for name, choice in entry.items():
                if name.startswith("override "):
                    selects.append(f"{name.removeprefix('override ').strip('/')}={choice}")
    own: dict[str, Key] = {}
    if isinstance(data, yaml.MappingNode) and not data.flow_style:
        if prefix and any(k.value == "_target_" for k, _ in data.value):  # the option is a node Hydra builds
            own[prefix.rstrip(".")] = Key(prefix.rstrip("."), "", node=True)
        _walk(lines, data, prefix, own, root=True)
    for path_, key in own.items():
        if path_ in keys and not key.doc:
            key.doc = keys[path_].doc
        keys[path_] = key
    return _file_doc(lines)


def _group_prefix(group: str) -> str:
    return "" if group == "" else group.replace("/", ".") + "."


def _options(group: str) -> list[str]:
    names = sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))
    default = default_options().get(group)
    return sorted(names, key=lambda n: n != default)


@functools.cache
def default_options() -> dict[str, str | None]:
    """Each group's default option: conf/config.yaml's defaults (and rollout's `step`)."""
    main = yaml.safe_load((config_dir() / "config.yaml").read_text())
    out = {}
    for entry in main["defaults"]:
        if isinstance(entry, dict):
            (name, choice), = entry.items()
            if not name.startswith("override "):
                out[name] = choice
    out["rollout/step"] = "single_turn"
    return out


@functools.cache
def options() -> dict[str, list[Option]]:
    """Per group ("" for conf/config.yaml), its options with their keys and comments."""
    main = Option("", "config", _file_doc((config_dir() / "config.yaml").read_text().splitlines()))
    _read_option(config_dir() / "config.yaml", "", main.keys, [])
    out: dict[str, list[Option]] = {"": [main]}
    for group in GROUPS:
        out[group] = []
        for name in _options(group):
            path = config_dir() / group / f"{name}.yaml"
            option = Option(group, name, "", global_package=path.read_text().startswith("# @package _global_"))
            option.doc = _read_option(path, _group_prefix(group), option.keys, option.selects)
            out[group].append(option)
    _split_overrides(out)
    for group in out.values():
        _fill_from_others(group)
    return out


def _split_overrides(groups: dict[str, list[Option]]) -> None:
    """A `@package _global_` option's keys of another group that group defines (`rollout.top_p` under task=lookup,
    `trainer.devices` under parallel=tp2) are values it sets, not keys of its own (their comments say why)."""
    home = {key for group, opts in groups.items() for option in opts for key in option.keys if _in_group(key, group)}
    for group, opts in groups.items():
        for option in opts if group else ():
            for path in [p for p in option.keys if not _in_group(p, group) and p in home]:
                option.sets.append(path)
                del option.keys[path]


def _in_group(path: str, group: str) -> bool:
    return not group or path == group.replace("/", ".") or path.startswith(_group_prefix(group))


def _fill_from_others(group: list[Option]) -> None:
    """A key without a comment takes the same key's comment from another option of its group, a plain one first
    (a `@package _global_` option's comments tend to say why it sets a value)."""
    docs: dict[str, str] = {}
    for option in sorted(group, key=lambda o: o.global_package):
        for key in option.keys.values():
            if key.doc:
                docs.setdefault(key.path, key.doc)
    for option in group:
        for key in option.keys.values():
            key.doc = key.doc or docs.get(key.path, "")


# ----- defaults as composed -----


@functools.cache
def _composed(group: str, name: str) -> dict:
    from hydra import compose, initialize_config_dir

    overrides = [f"{group}={name}"] if group else []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="train"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


def _lookup(tree: dict, path: str) -> object:
    node: object = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def format_value(value: object) -> str:
    """A value as a user types it on the command line (yaml flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return str(value)


# ----- the page -----


def key_docs(key: Key) -> str:
    """The key's meaning: its comment, else the key its value follows, else (a node Hydra builds) its role."""
    if key.doc:
        return key.doc
    if key.follows:
        return f"follows `{key.follows}`"
    return "built by Hydra: its arguments are the keys below" if key.node else ""


def missing_comments() -> list[str]:
    """The keys (with their option) that have no comment: none of their own, from a base option or another
    option of their group, and no key they follow; and the keys an experiment sets that no section documents."""
    missing = [f"{key.path} ({group}={option.name})" if group else key.path
               for group, opts in options().items() if group != "experiment" for option in opts
               for key in option.keys.values() if not (key.node or key.doc or key.follows)]
    documented = {key.path for group, opts in options().items() if group != "experiment" for option in opts
                  for key in option.keys.values()}
    for option in options()["experiment"]:
        for path in option.sets + [path for path, key in option.keys.items() if not key.node]:
            parts = path.split(".")
            if not any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)):
                missing.append(f"{path} (experiment={option.name}: a key no other section documents)")
    return missing


@dataclass
class Row:
    path: str
    doc: str
    defaults: dict[str, list[str]] = field(default_factory=dict)  # value -> options


def _rows(group: str, opts: list[Option]) -> list[Row]:
    """One row per key and meaning, with each option's default as composed with that option selected."""
    rows: dict[tuple[str, str], Row] = {}
    for option in opts:
        composed = _composed(group, option.name)
        for key in option.keys.values():
            value = _lookup(composed, key.path)
            if key.node and not key.doc and not (isinstance(value, dict) and "_target_" in value):
                continue  # a plain section without a comment: its keys have rows
            doc = key_docs(key)
            row = rows.setdefault((key.path, doc), Row(key.path, doc))
            row.defaults.setdefault(_shown(value), []).append(option.name)
    return list(rows.values())


SECTION = "—"  # a node's Default cell: its keys have their own rows


def _shown(value: object) -> str:
    if isinstance(value, dict) and value:
        return f"builds {value['_target_']}" if "_target_" in value else SECTION
    return format_value(value)


def _value_cell(shown: str) -> str:
    if shown == SECTION:
        return shown
    return f"builds {_code(shown.removeprefix('builds '))}" if shown.startswith("builds ") else _code(shown)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`"


def _defaults_cell(row: Row) -> str:
    if len(row.defaults) == 1:
        return _value_cell(next(iter(row.defaults)))
    return "; ".join(f"{_value_cell(v)} ({', '.join(opts)})" for v, opts in row.defaults.items())


def _options_cell(row: Row, names: list[str]) -> str:
    have = [n for n in names if any(n in opts for opts in row.defaults.values())]
    return "all" if have == names else ", ".join(have)


def _table(rows: list[Row], names: list[str] | None) -> list[str]:
    if names is None or len(names) == 1:
        out = ["| Key | Default | Meaning |", "|---|---|---|"]
        out += [f"| `{r.path}` | {_defaults_cell(r)} | {_cell(r.doc)} |" for r in rows]
    else:
        out = ["| Key | Default | Options | Meaning |", "|---|---|---|---|"]
        out += [f"| `{r.path}` | {_defaults_cell(r)} | {_options_cell(r, names)} | {_cell(r.doc)} |"
                for r in rows]
    return out


INTRO = """\
# Config reference

Every key of every config group option: its default (as composed with that option selected) and what it does.
Generated from the comments in `conf/` by `python -m topp_rl.config_reference` (do not edit this page: edit the
comment, then rerun it; `tests/test_config_reference.py` fails when a key has no comment or this page is stale).
`topp-rl train --help` prints the most used of these keys with the same text and the values of its composition.

On the command line (`python train.py` or `topp-rl train`; `topp_rl.fit(overrides=[...])` takes the same):

- `group=option` picks an option of a group: `algo=cispo`, `rollout=sglang`, `rollout/step=agent`;
- `key=value` sets a key the config has: `rollout.top_p=0.9`, `optimizer.lr=1e-5`, `logger.wandb.tags=[a,b]`;
- `+key=value` adds a key it lacks (a constructor argument of a `_target_` node: `+logger.wandb.entity=my-team`);
  in the closed sections (the top level, `rollout`, `algo`, `module`, `eval`, ...) a key no option defines is
  refused at start, naming the nearest one; `~key` or `key=null` drops one.

A node with `_target_` is built by Hydra (the Default column says what it builds): its other keys are the
constructor's arguments. `${a.b}` in a default follows key `a.b`; `???` must be set. `--cfg job` prints the
whole composed config.
"""


def _group_title(group: str) -> str:
    return group or "Top level (conf/config.yaml)"


def render() -> str:
    """docs/config.md: the intro, then per group its options and a table of their keys."""
    groups = options()
    parts = [INTRO, "Sections: " + ", ".join(
        f"[{_group_title(g)}](#{_anchor(_group_title(g))})" for g in groups) + ".", ""]
    for group, opts in groups.items():
        parts += [f"## {_group_title(group)}", ""]
        if group:
            default = default_options().get(group)
            pick = "`experiment=NAME`, none by default; applied last, over everything" if group == "experiment" else (
                f"`{group}=NAME`, default `{default}`")
            parts += [f"Options ({pick}):", ""]
            for option in opts:
                parts.append(f"- `{option.name}`: {option.doc}{_sets(group, option)}")
            parts.append("")
        else:
            parts += [opts[0].doc, ""]
        if group == "experiment":
            parts += _experiment_lines(opts)
            continue
        names = [o.name for o in opts] if group else None
        parts += _table(_rows(group, opts), names) + [""]
    return "\n".join(parts).rstrip() + "\n"


def _sets(group: str, option: Option) -> str:
    """What an option selects and sets outside its group (`rollout.top_p=0.9` under task=lookup)."""
    if group == "experiment":
        return ""
    composed = _composed(group, option.name)
    values = [f"{path}={format_value(_lookup(composed, path))}" for path in option.sets
              if not isinstance(_lookup(composed, path), dict)]
    words = option.selects + values
    return f" Sets {', '.join(_code(w) for w in words)}." if words else ""


def _anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _experiment_lines(opts: list[Option]) -> list[str]:
    """An experiment sets keys the other sections document: the values as its file writes them."""
    out = ["| Experiment | Sets |", "|---|---|"]
    for option in opts:
        data = yaml.safe_load((config_dir() / "experiment" / f"{option.name}.yaml").read_text()) or {}
        sets = [f"{k}={format_value(v)}" for k, v in _leaves(data, "")]
        out.append(f"| `{option.name}` | {', '.join(_code(s) for s in option.selects + sets)} |")
    return out + [""]


def _leaves(data: dict, prefix: str) -> list[tuple[str, object]]:
    out = []
    for key, value in data.items():
        if not prefix and key == "defaults":
            continue
        if isinstance(value, dict) and value and "_target_" not in value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


# ----- --help -----


@functools.cache
def _help_docs() -> dict[str, tuple[str, str]]:
    """Per key, its comment and the first option that defines it (`group=option`, "" for conf/config.yaml)."""
    out: dict[str, tuple[str, str]] = {}
    for group, opts in options().items():
        for option in sorted(opts, key=lambda o: o.global_package):  # as `_fill_from_others` picks
            for key in option.keys.values():
                if key.doc:
                    out.setdefault(key.path, (key.doc, f"{group}={option.name}" if group else ""))
    return out


def key_help(path: str, *, _root_: DictConfig) -> str:
    """`${topp_rl.key_help:rollout.top_p}` in the help template: `rollout.top_p [0.9]  <its comment>`, wrapped,
    with the value of this composition (or the option that defines the key, where this one does not)."""
    if path not in _help_docs():
        raise ValueError(f"--help lists {path!r}, which no option of conf/ defines with a comment: add one")
    doc, where = _help_docs()[path]
    parent, _, name = path.rpartition(".")
    node = OmegaConf.select(_root_, parent) if parent else _root_
    if not isinstance(node, DictConfig) or name not in node.keys():  # another option's key: model.path
        head = f"{path} ({where})"
    elif OmegaConf.is_missing(node, name):
        head = f"{path} [???]"
    else:
        value = node[name]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        head = f"{path} [{format_value(value)}]"
    return "\n  ".join(textwrap.wrap(f"{head}  {doc}", width=112, subsequent_indent="  "))  # the template indents 2


def register_help_resolver() -> None:
    if not OmegaConf.has_resolver("topp_rl.key_help"):
        OmegaConf.register_new_resolver("topp_rl.key_help", key_help)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m topp_rl.config_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a key has no comment or the page differs")
    parser.add_argument("--out", type=Path, default=CHECKOUT_ROOT / PAGE)
    args = parser.parse_args(argv)
    missing = missing_comments()
    if missing:
        sys.exit("keys without a comment in conf/ (add one: a trailing # comment or the lines above the key):\n  "
                 + "\n  ".join(missing))
    page = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != page:
            sys.exit(f"{args.out} is stale: run python -m topp_rl.config_reference")
        return
    args.out.write_text(page)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
