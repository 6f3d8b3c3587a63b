#!/usr/bin/env python3
"""The documentation's links resolve: every relative link of README.md, docs/*.md and
bench/*.md names a file or folder of the repository, and its #anchor (if any) a heading of
that Markdown file (GitHub's heading ids). README.md links every page of docs/, and
docs/architecture.md names every folder of the code (lua/moonrl/*/, core/*/, kernels/*/), so
the page that describes the code as built cannot silently miss a part of it.

usage: test_docs_links.py SOURCE_ROOT
"""
import os
import re
import sys

LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def strip_code(text):
    """The text without fenced code blocks and inline code (their brackets are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def slug(heading):
    """GitHub's id of a heading: lower case, punctuation dropped, spaces as hyphens."""
    h = re.sub(r"`", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        ids, seen, fenced = set(), {}, False
        for line in open(path, encoding="utf-8"):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                ids.add(s if n == 0 else "%s-%d" % (s, n))
        cache[path] = ids
    return cache[path]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    files = [os.path.join(root, "README.md")]
    for folder in ("docs", "bench"):
        d = os.path.join(root, folder)
        files += sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".md"))
    bad, count = [], 0
    readme_targets = set()
    for f in files:
        text = strip_code(open(f, encoding="utf-8").read())
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                count += 1
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
                where = "%s:%d: %s" % (os.path.relpath(f, root), lineno, target)
                if not os.path.exists(dest):
                    bad.append(where + ": no such file")
                    continue
                if f.endswith("README.md") and os.path.dirname(f) == root:
                    readme_targets.add(os.path.relpath(dest, root))
                if anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    bad.append(where + ": no heading with this id in " + os.path.relpath(dest, root))
    for n in sorted(os.listdir(os.path.join(root, "docs"))):
        if n.endswith(".md") and "docs/" + n not in readme_targets:
            bad.append("README.md: no link to docs/" + n)
    arch = open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8").read()
    for parent, shown in (("lua/moonrl", ("`{}/`", "`moonrl.{}.", "`moonrl.{}`")), ("core", ("`core/{}/`",)),
                          ("kernels", ("`kernels/{}/`", "`kernels/{}`"))):
        for n in sorted(os.listdir(os.path.join(root, parent))):
            if os.path.isdir(os.path.join(root, parent, n)) and n != "include" and \
                    not any(w.format(n) in arch for w in shown):
                bad.append("docs/architecture.md: %s/%s/ is not described (no %s)" % (parent, n, shown[0].format(n)))
    for b in bad:
        print("FAIL " + b)
    print("%d links checked in %d files; %d passed, %d failed" % (count, len(files), count - len(bad), len(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
