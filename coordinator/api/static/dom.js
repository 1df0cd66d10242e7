// The page's small DOM helpers, shared by its modules.

/** The element of id `id`. */
export const $ = (id) => document.getElementById(id);

/** A DOM element: el("div", {class: "x"}, "text", child, ...); text always goes in as text, never HTML.
 * Attributes that are undefined, null or false are left out; true is an empty attribute. */
export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

/** Show `text` in the banner above the messages; empty hides it. */
export function banner(text) {
  $("banner").textContent = text || "";
  $("banner").hidden = !text;
}
