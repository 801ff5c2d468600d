#!/usr/bin/env python3
"""Lists skiplock's public API from the rustdoc HTML of the library alone (default features).

Reads target/doc/skiplock/all.html and every item page it links, and prints one block per
item: its path and kind, its declaration, and the headers of its methods and trait
implementations (auto-trait and blanket implementations left out: they follow from the
rest). The output is committed as docs/public-api.txt and compared by .ci/run, so a change
to the surface shows as a diff.

Usage: .ci/public-api.py [DOC_DIR]   (default target/doc/skiplock)
"""
import html
import os
import re
import sys

doc = sys.argv[1] if len(sys.argv) > 1 else "target/doc/skiplock"


def text(fragment):
    """The visible text of an HTML fragment, on one line."""
    fragment = re.sub(r"<(span|a) [^>]*class=\"[^\"]*(src|anchor|since)[^\"]*\"[^>]*>.*?</\1>", "", fragment, flags=re.S)
    fragment = re.sub(r"<br\s*/?>", " ", fragment)
    fragment = re.sub(r"<[^>]+>", "", fragment)
    return " ".join(html.unescape(fragment).split())


with open(os.path.join(doc, "all.html"), encoding="utf-8") as f:
    index = f.read()
links = sorted(set(re.findall(r'<li><a href="([^"#]+\.html)">', index)))
if not links:
    sys.exit(f"{doc}/all.html lists no items: is this rustdoc's output?")

out = []
for link in links:
    with open(os.path.join(doc, link), encoding="utf-8") as f:
        page = f.read()
    kind = os.path.basename(link).split(".")[0]
    path = "skiplock::" + "::".join(os.path.dirname(link).split("/") + [os.path.basename(link).split(".")[1]]).lstrip(":")
    decl = re.search(r'<pre class="rust item-decl"><code>(.*?)</code></pre>', page, flags=re.S)
    out.append(f"{kind} {path}")
    if decl:
        # Long declarations (structs, traits) keep their fields and items, one per line.
        body = re.sub(r"<br\s*/?>", "\n", decl.group(1))
        for line in html.unescape(re.sub(r"<[^>]+>", "", body)).splitlines():
            line = line.strip()
            if line and not line.startswith("//"):
                out.append("    " + line)
    for section in ("synthetic-implementations", "blanket-implementations"):
        cut = page.find(f'id="{section}"')
        if cut != -1:
            page = page[:cut]
    for header in re.findall(r'<h[34] class="code-header">(.*?)</h[34]>', page, flags=re.S):
        out.append("    " + text(header))
    out.append("")
print("\n".join(out).rstrip("\n"))
