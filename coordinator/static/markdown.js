// A small markdown renderer for model answers: paragraphs (single newlines kept as line breaks), headings,
// bullet and numbered lists (nested by indentation), block quotes, fenced code blocks (also unclosed ones,
// as a streaming answer has them), pipe tables, rules, and inline **bold**, *italic*, ~~strike~~, `code`
// and [links](https://...). Every piece of the source text is HTML-escaped before any tag is added, and
// links take only http(s) and mailto addresses, so an answer can never inject markup or script.
// Crafted text can neither crash nor stall it: quotes and lists nest at most MAX_DEPTH deep (deeper
// markers stay text, as no call stack can take ">" x 20,000 as 20,000 nested quotes), and no pattern
// backtracks over a line or a block more than a bounded number of times (200 KB of "**a " took 3 s).
"use strict";

(function () {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  const MAX_DEPTH = 16;
  const FENCE = /^ {0,3}(`{3,}|~{3,})(.*)$/;  // the info string (.*) is checked in fence()
  const HEADING = /^ {0,3}(#{1,6})\s(.*)$/;  // closing #s and spaces are cut in heading()
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  // Emphasis on text that is already escaped (so `*`, `_` and `~` are still literal characters).
  // A span's content never holds its own delimiter pair, so a match attempt stops at the next pair
  // instead of scanning (and backtracking over) the rest of the block.
  function emphasis(s) {
    return s
      .replace(/\*\*(?=\S)((?:[^*]|\*(?!\*))*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)((?:[^_]|_(?!_))*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/\*(?=[^\s*])([^*]*?[^\s*]|[^\s*])\*/g, "<em>$1</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)((?:[^~]|~(?!~))*?\S)~~/g, "<del>$1</del>");
  }

  // Inline markdown of one block's raw text. Code spans and links are set aside first (as private-use
  // placeholders, so emphasis may span them): a code span's content is only escaped, a link's address is
  // escaped and never touched by the emphasis rules. A label or an address stops at the next bracket.
  const SPANS = /(`+)([\s\S]*?[^`])\1(?!`)|\[([^[\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)[\]]+)\)/g;
  const HOLE = /\uE000(\d+)\uE001/g;
  function inline(raw) {
    const spans = [];
    const text = raw.replace(/[\uE000\uE001]/g, "\uFFFD").replace(SPANS, (_, ticks, code, label, href) => {
      spans.push(ticks !== undefined
        ? "<code>" + escapeHtml(code.replace(/^ (.*) $/, "$1")) + "</code>"
        : `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${emphasis(escapeHtml(label))}</a>`);
      return `\uE000${spans.length - 1}\uE001`;
    });
    return emphasis(escapeHtml(text)).replace(HOLE, (_, i) => spans[Number(i)]);
  }

  const lines = (text) => inline(text.join("\n")).replace(/\n/g, "<br>");

  function codeBlock(source, language) {
    const cls = language ? ` class="language-${escapeHtml(language)}"` : "";
    const label = `<span class="lang">${language ? escapeHtml(language) : ""}</span>`;
    return `<div class="code"><div class="code-head">${label}` +
      `<button type="button" class="copy" title="copy the code">Copy</button></div>` +
      `<pre><code${cls}>${escapeHtml(source.join("\n"))}</code></pre></div>`;
  }

  function splitRow(line) {
    return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
  }

  function table(rows) {
    const head = splitRow(rows[0]).map((c) => `<th>${inline(c)}</th>`).join("");
    const body = rows.slice(2).map((r) => "<tr>" + splitRow(r).map((c) => `<td>${inline(c)}</td>`).join("") +
      "</tr>").join("");
    return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
  }

  // A list starting at lines[i]; returns [html, next index]. Items deeper than the list's own indent
  // nest (up to MAX_DEPTH: deeper ones continue the item before them as text); indented lines without
  // a marker continue the item before them.
  function list(src, i, depth) {
    const first = ITEM.exec(src[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const start = ordered ? parseInt(first[2], 10) : 1;
    let html = ordered ? (start !== 1 ? `<ol start="${start}">` : "<ol>") : "<ul>";
    let item = null;
    const flush = () => { if (item !== null) html += `<li>${lines(item.text)}${item.children}</li>`; };
    while (i < src.length) {
      const line = src[i];
      const m = ITEM.exec(line);
      if (m && m[1].length > indent && item !== null && depth < MAX_DEPTH) {
        const [nested, next] = list(src, i, depth + 1);
        item.children += nested;
        i = next;
        continue;
      }
      if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
        flush();
        item = { text: [m[3]], children: "" };
      } else if (item !== null && line.trim() !== "" && /^\s/.test(line) && (!m || m[1].length > indent)) {
        item.text.push(line.trim());
      } else {
        break;
      }
      i++;
    }
    flush();
    return [html + (ordered ? "</ol>" : "</ul>"), i];
  }

  // The opening fence of a code block: [fence, language] or null (a backtick fence's info string has
  // no backtick).
  function fence(line) {
    const m = FENCE.exec(line);
    if (!m || (m[1][0] === "`" && m[2].includes("`"))) return null;
    return [m[1], m[2].trim().split(/\s/)[0]];
  }

  // A heading's text without its closing #s (which must follow a space) and spaces.
  function heading(m) {
    const text = (m[2] || "").trim();
    const cut = text.replace(/#+$/, "");
    return cut === "" || /\s$/.test(cut) ? cut.trim() : text;
  }

  function blocks(src, depth) {
    let html = "";
    let para = [];
    const endPara = () => { if (para.length) html += `<p>${lines(para)}</p>`; para = []; };
    for (let i = 0; i < src.length;) {
      const line = src[i];
      let m;
      if ((m = fence(line))) {
        endPara();
        const fence = m[0];
        const closes = (l) => {
          const t = l.trim();
          return t.length >= fence.length && t === fence[0].repeat(t.length);
        };
        const body = [];
        for (i++; i < src.length && !closes(src[i]); i++) body.push(src[i]);
        html += codeBlock(body, m[1]);
        i++;  // the closing fence (past the end when the block is still streaming)
      } else if (line.trim() === "") {
        endPara();
        i++;
      } else if ((m = HEADING.exec(line))) {
        endPara();
        const level = m[1].length;
        html += `<h${level}>${inline(heading(m))}</h${level}>`;
        i++;
      } else if (RULE.test(line)) {
        endPara();
        html += "<hr>";
        i++;
      } else if (depth < MAX_DEPTH && QUOTE.test(line)) {
        endPara();
        const quoted = [];
        for (; i < src.length && (m = QUOTE.exec(src[i])); i++) quoted.push(m[1]);
        html += `<blockquote>${blocks(quoted, depth + 1)}</blockquote>`;
      } else if (ITEM.test(line) && (para.length === 0 || ITEM.exec(line)[1].length === 0)) {
        endPara();
        const [rendered, next] = list(src, i, depth);
        html += rendered;
        i = next;
      } else if (line.includes("|") && i + 1 < src.length && TABLE_SEP.test(src[i + 1]) && src[i + 1].includes("-")) {
        endPara();
        const rows = [line, src[i + 1]];
        for (i += 2; i < src.length && src[i].includes("|") && src[i].trim() !== ""; i++) rows.push(src[i]);
        html += table(rows);
      } else {
        para.push(line);
        i++;
      }
    }
    endPara();
    return html;
  }

  /** The HTML of markdown `text` (string); every character of `text` is escaped, so the result is safe
   * to assign to innerHTML. */
  function renderMarkdown(text) {
    return blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), 0);
  }

  window.renderMarkdown = renderMarkdown;
  window.escapeHtml = escapeHtml;
})();
