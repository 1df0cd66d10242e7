// The chat page's markdown renderer (coordinator/api/static/markdown.js: markdown-it, html off, links sanitised).
import assert from "node:assert/strict";
import { test } from "node:test";
import { MAX_DEPTH, renderMarkdown } from "../../coordinator/api/static/markdown.js";

const LINK = 'target="_blank" rel="noopener noreferrer"';
const flat = (html) => html.replace(/\n/g, "");

test("***x*** nests strong inside em", () => {
  assert.equal(flat(renderMarkdown("***x***")), "<p><em><strong>x</strong></em></p>");
  assert.equal(flat(renderMarkdown("a ***b*** c")), "<p>a <em><strong>b</strong></em> c</p>");
});

test("a fenced code block inside a list item stays a block, with its language and Copy button", () => {
  const html = flat(renderMarkdown("1. Install:\n   ```bash\n   pip install x\n   ```\n2. Run it"));
  assert.match(html, /^<ol><li>Install:<div class="code">/);
  assert.match(html, /<button type="button" class="copy"[^>]*>Copy<\/button>/);
  assert.ok(html.includes('<pre><code class="language-bash">pip install x</code></pre></div></li><li>Run it</li></ol>'),
    html);
  assert.doesNotMatch(html, /<p><code>/);
});

test("a list with blank lines between its items stays one list", () => {
  const html = flat(renderMarkdown("- one\n\n- two\n\n- three"));
  assert.equal(html, "<ul><li><p>one</p></li><li><p>two</p></li><li><p>three</p></li></ul>");
  const ordered = flat(renderMarkdown("1. a\n\n2. b\n\n3. c"));
  assert.equal((ordered.match(/<ol>/g) || []).length, 1, ordered);
  assert.equal((ordered.match(/<li>/g) || []).length, 3, ordered);
});

test("raw HTML is text (html: false)", () => {
  assert.equal(flat(renderMarkdown("<img src=x onerror=alert(1)> & <script>alert(1)</script>")),
    "<p>&lt;img src=x onerror=alert(1)&gt; &amp; &lt;script&gt;alert(1)&lt;/script&gt;</p>");
  assert.equal(flat(renderMarkdown("<div>\n<b>x</b>\n</div>")),
    "<p>&lt;div&gt;<br>&lt;b&gt;x&lt;/b&gt;<br>&lt;/div&gt;</p>");
  assert.ok(!renderMarkdown("`<b>`").includes("<b>"));
  assert.ok(flat(renderMarkdown("```\n<script>x</script>\n```"))
    .includes("<code>&lt;script&gt;x&lt;/script&gt;</code>"));
});

test("links go only to http(s) and mailto addresses, in a new tab without opener or referrer", () => {
  assert.equal(flat(renderMarkdown("[y](https://a.org/b_c_d)")), `<p><a href="https://a.org/b_c_d" ${LINK}>y</a></p>`);
  assert.equal(flat(renderMarkdown("[m](mailto:a@b.org)")), `<p><a href="mailto:a@b.org" ${LINK}>m</a></p>`);
  for (const bad of ["javascript:alert(1)", "JavaScript:alert(1)", "vbscript:x", "data:text/html;base64,PHNjcmlwdD4=",
    "file:///etc/passwd", "/relative", "//evil.example/x", "ftp://a.org/f", "  javascript:alert(1)"]) {
    const html = renderMarkdown(`[x](${bad}) <${bad}>`);
    assert.ok(!html.includes("<a "), `${bad}: ${html}`);
    assert.ok(!html.includes("href"), `${bad}: ${html}`);
  }
  // a reference-style link to javascript: is refused too
  assert.ok(!renderMarkdown("[x][r]\n\n[r]: javascript:alert(1)").includes("<a "));
  // a title cannot break out of its attribute
  assert.ok(flat(renderMarkdown('[a](http://x "t\\"onclick=1")')).includes('title="t&quot;onclick=1"'));
});

test("bare http(s) and e-mail addresses become links; file names and schemeless hosts do not", () => {
  assert.equal(flat(renderMarkdown("see https://example.org/x.")),
    `<p>see <a href="https://example.org/x" ${LINK}>https://example.org/x</a>.</p>`);
  assert.ok(renderMarkdown("write to a@b.org").includes(`<a href="mailto:a@b.org" ${LINK}>a@b.org</a>`));
  for (const text of ["edit setup.py and main.rs", "www.example.org", "//example.org", "ftp://a.org"]) {
    assert.ok(!renderMarkdown(text).includes("<a "), text);
  }
});

test("images are not made (the page's CSP refuses them)", () => {
  const html = renderMarkdown("![alt](https://a.org/i.png)");
  assert.ok(!html.includes("<img"), html);
});

test("the page's old cases: emphasis, code, nested lists, line breaks, tables, quotes, headings", () => {
  assert.equal(flat(renderMarkdown("**bold** *it* `a<b>` snake_case ~~gone~~")),
    "<p><strong>bold</strong> <em>it</em> <code>a&lt;b&gt;</code> snake_case <s>gone</s></p>");
  assert.equal(flat(renderMarkdown("- a\n- b\n  1. c")), "<ul><li>a</li><li>b<ol><li>c</li></ol></li></ul>");
  assert.equal(flat(renderMarkdown("line\nnext\n\npara")), "<p>line<br>next</p><p>para</p>");
  assert.ok(flat(renderMarkdown("|a|b|\n|-|-|\n|1|2|")).includes("<table><thead><tr><th>a</th><th>b</th></tr></thead>" +
    "<tbody><tr><td>1</td><td>2</td></tr></tbody></table>"));
  assert.equal(flat(renderMarkdown("> q")), "<blockquote><p>q</p></blockquote>");
  assert.equal(flat(renderMarkdown("## Title ##")), "<h2>Title</h2>");
  assert.equal(flat(renderMarkdown("---")), "<hr>");
});

test("code blocks: language escaped, an unclosed fence (a streaming answer) is still a block", () => {
  const code = flat(renderMarkdown("```python\nx = '<b>'\n```\nafter"));
  assert.ok(code.includes('<pre><code class="language-python">x = \'&lt;b&gt;\'</code></pre>'), code);
  assert.ok(code.endsWith("<p>after</p>"), code);
  assert.ok(flat(renderMarkdown("```\ndef f():")).includes("<pre><code>def f():</code></pre>"));
  assert.ok(flat(renderMarkdown('```js" onclick="x\nx\n```')).includes('class="language-js&quot;"'));
  assert.ok(flat(renderMarkdown("    indented")).includes('<div class="code">'));
});

test("deep nesting is kept as text, not dropped", () => {
  const html = renderMarkdown(">".repeat(20000));
  assert.equal((html.match(/<blockquote>/g) || []).length, MAX_DEPTH);
  assert.ok((html.match(/&gt;/g) || []).length >= 20000 - MAX_DEPTH, "the deeper markers stay as text");
  const list = renderMarkdown(Array.from({ length: 40 }, (_, i) => "  ".repeat(i) + "- item" + i).join("\n"));
  assert.ok(list.includes("item39"), "the deepest item's text is kept");
});

test("any value is rendered as its text", () => {
  assert.equal(flat(renderMarkdown(42)), "<p>42</p>");
  assert.equal(flat(renderMarkdown(null)), "<p>null</p>");
  assert.equal(renderMarkdown(""), "");
});

// tests/integration/test_hostile_http.py times these in Chromium (1 s each; they stalled the first renderer for
// 3 to 18 s); most take 1-200 ms here, the budget leaves room for a busy machine
const HOSTILE = {
  "quote x 20000": ">".repeat(20000),
  "list 12000 deep": Array.from({ length: 12000 }, (_, i) => " ".repeat(i) + "- a").join("\n"),
  "'**a ' x 50000": "**a ".repeat(50000),
  "'__a ' x 50000": "__a ".repeat(50000),
  "'~~a ' x 50000": "~~a ".repeat(50000),
  "'[' x 200000": "[".repeat(200000),
  "'[a](http://' x 18000": "[a](http://".repeat(18000),
  "heading with 200 KB of spaces": "# a" + " ".repeat(200000) + "b",
  "fence with 200 KB of spaces": "``` " + " ".repeat(200000) + "`x",
  "'> - ' x 50000": "> - ".repeat(50000),
  "'![' x 100000": "![".repeat(100000),
  "'`a' x 100000": "`a".repeat(100000),
  "'<a' x 100000": "<a".repeat(100000),
  "'http://a.b ' x 20000": "http://a.b ".repeat(20000),
};

// A stall is quadratic or worse: at these sizes minutes, not seconds. The bound leaves room for a loaded machine
// (a parallel suite measured 1.1 s for '[' x 200000 here, 0.1-0.3 s quiet).
const STALL_MS = 5000;

test("crafted text neither throws nor stalls", () => {
  for (const [name, text] of Object.entries(HOSTILE)) {
    const start = performance.now();
    const html = renderMarkdown(text);
    const took = performance.now() - start;
    assert.equal(typeof html, "string", name);
    assert.ok(took < STALL_MS, `${name}: ${took.toFixed(0)} ms`);
  }
});
