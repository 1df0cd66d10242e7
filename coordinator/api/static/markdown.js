// Model answers as HTML, by markdown-it (vendor/markdown-it.esm.min.js: markdown-it 15.0.3, MIT, its LICENSE
// beside it; vendor/README.md says where it came from). CommonMark plus pipe tables and ~~strike~~, single
// newlines kept as line breaks, bare http(s):// and e-mail addresses made links.
// Safe to assign to innerHTML: raw HTML in the text is escaped (html: false), links go only to http(s) and
// mailto addresses (anything else stays text) and open in a new tab without an opener or a referrer, and
// images are not made (the page's CSP would refuse them anyway). Pure: no DOM, so node's tests import it.
// Crafted text can neither crash nor stall it (tests/integration/test_hostile_http.py times the texts that
// stalled the page's first renderer): blocks nest at most MAX_DEPTH levels (a quote is one, a list item
// two), what lies deeper is kept as the text of one paragraph (markdown-it's own nesting limit drops it).
import markdownit from "./vendor/markdown-it.esm.min.js";

/** How deep blocks nest before the rest of a block is kept as plain paragraph text. */
export const MAX_DEPTH = 20;
const SAFE_LINK = /^(https?:\/\/|mailto:)/i;
const MAX_INDENT = 256;
const LONG_INDENT = /^[ \t]{257,}/gm;  // more than MAX_INDENT

const md = markdownit({ html: false, linkify: true, breaks: true, typographer: false, maxNesting: MAX_DEPTH + 12 });
md.linkify.set({ fuzzyLink: false, fuzzyIP: false });  // "setup.py" is a file name, not a link to Paraguay
md.linkify.add("ftp:", null).add("//", null);
md.validateLink = (url) => SAFE_LINK.test(url.trim());
md.disable("image");

// Past MAX_DEPTH the rest of the container is one paragraph of plain text (its runs of spaces made one).
md.block.ruler.before("table", "too_deep", (state, startLine, endLine, silent) => {
  if (silent || state.level < MAX_DEPTH) return false;
  const open = state.push("paragraph_open", "p", 1);
  open.map = [startLine, endLine];
  const text = state.getLines(startLine, endLine, state.blkIndent, false);
  state.push("text", "", 0).content = text.replace(/[ \t]+/g, " ").trim();
  state.push("paragraph_close", "p", -1);
  state.line = endLine;
  return true;
});

const escapeHtml = md.utils.escapeHtml;

// A code block with its language and a Copy button (coordinator/api/static/messages.js copies its text).
function codeBlock(content, info) {
  const language = md.utils.unescapeAll(info || "").trim().split(/\s+/)[0];
  const cls = language ? ` class="language-${escapeHtml(language)}"` : "";
  return `<div class="code"><div class="code-head"><span class="lang">${escapeHtml(language)}</span>` +
    `<button type="button" class="copy" title="copy the code">Copy</button></div>` +
    `<pre><code${cls}>${escapeHtml(content.replace(/\n$/, ""))}</code></pre></div>\n`;
}
md.renderer.rules.fence = (tokens, i) => codeBlock(tokens[i].content, tokens[i].info);
md.renderer.rules.code_block = (tokens, i) => codeBlock(tokens[i].content, "");

md.renderer.rules.link_open = (tokens, i, options, env, self) => {
  tokens[i].attrSet("target", "_blank");
  tokens[i].attrSet("rel", "noopener noreferrer");
  return self.renderToken(tokens, i, options);
};

/** The HTML of markdown `text` (any value: made a string), safe to assign to innerHTML. A line's leading
 * blanks count up to MAX_INDENT: no block nests deep enough to need more (they cost time on every byte:
 * 12,000 list items indented 0 to 12,000 deep are 72 MB of spaces). */
export function renderMarkdown(text) {
  return md.render(String(text).replace(LONG_INDENT, (blanks) => blanks.slice(0, MAX_INDENT)));
}
