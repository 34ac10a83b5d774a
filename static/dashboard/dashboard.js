// The dashboard's only script of its own (the CSP allows no inline script). Everything works
// without it; it adds "select all", closing the confirmation dialog, resting a form's buttons
// while it is sent, showing a refused action's reason, and the live indicator.
(function () {
  "use strict";

  document.addEventListener("change", function (event) {
    var box = event.target;
    if (!box.matches) return;
    var form = box.form || box.closest("form");
    if (!form) return;
    if (box.matches("[data-select-all]")) {
      form.querySelectorAll("input[type=checkbox][name=ids]").forEach(function (item) {
        item.checked = box.checked;
      });
    } else if (box.matches("input[type=checkbox][name=ids]")) {
      selectAllSays(form);
    }
  });
  // "Select all" says whether every run of the page is ticked, or some (a live update
  // re-renders it unticked).
  function selectAllSays(form) {
    var all = form.querySelector("[data-select-all]");
    if (!all) return;
    var boxes = form.querySelectorAll("input[type=checkbox][name=ids]");
    var ticked = form.querySelectorAll("input[type=checkbox][name=ids]:checked").length;
    all.checked = boxes.length > 0 && ticked === boxes.length;
    all.indeterminate = ticked > 0 && ticked < boxes.length;
  }

  // The element that opened the confirmation dialog gets the focus back when it closes (a
  // keyboard user was sent to the top of the page).
  // A live update may have replaced it meanwhile (the list and its bar are re-rendered): its
  // replacement, found by the same id, or the same form, name, value and words, gets it then.
  var opener = null;
  function keyOf(el) {
    var form = el.closest("form[id]");
    return { id: el.id, form: form ? form.id : "", name: el.getAttribute("name") || "",
             value: el.getAttribute("value") || "", text: el.textContent, tag: el.tagName };
  }
  function replacementOf(key) {
    if (key.id) return document.getElementById(key.id);
    var scope = key.form ? document.getElementById(key.form) : document;
    var same = scope ? Array.prototype.filter.call(scope.getElementsByTagName(key.tag), function (el) {
      return (el.getAttribute("name") || "") === key.name && el.textContent === key.text &&
        (el.getAttribute("value") || "") === key.value;
    }) : [];
    return same.length === 1 ? same[0] : null;
  }
  document.addEventListener("htmx:beforeRequest", function (event) {
    var target = event.detail.target, elt = event.detail.elt;
    if (!target || target.id !== "dialog" || !elt || elt.closest("#dialog")) return;
    var active = document.activeElement;  // the button pressed, focused by the press
    var pressed = active && active !== document.body && elt.contains(active) ? active
      : elt.tagName === "FORM" ? elt.querySelector("button:not([type=button])") : elt;
    opener = pressed ? { element: pressed, key: keyOf(pressed) } : null;
  });
  function closeDialog() {
    var dialog = document.getElementById("dialog");
    if (!dialog || !dialog.innerHTML) return false;
    dialog.innerHTML = "";
    var back = opener && (document.body.contains(opener.element) ? opener.element
      : replacementOf(opener.key));
    if (back) back.focus();
    opener = null;
    return true;
  }

  document.addEventListener("click", function (event) {
    var close = event.target.closest && event.target.closest("[data-close-dialog]");
    if (close && closeDialog()) event.preventDefault();
  });

  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape") closeDialog();
    if (event.key === "Tab") holdFocusIn(event);
  });
  // While the confirmation is open, Tab goes round its own buttons and links (it is modal: the
  // page behind it does not take the focus, as a keyboard reader lost it there).
  function holdFocusIn(event) {
    var modal = document.querySelector("#dialog .modal");
    if (!modal) return;
    var parts = Array.prototype.filter.call(
      modal.querySelectorAll("a[href], button, input:not([type=hidden]), select, textarea, [tabindex]"),
      function (el) { return !el.disabled && el.tabIndex >= 0 && el.getClientRects().length; });
    if (!parts.length) return;
    var first = parts[0], last = parts[parts.length - 1], active = document.activeElement;
    var inside = modal.contains(active);
    if (event.shiftKey && (!inside || active === first)) {
      event.preventDefault();
      last.focus();
    } else if (!event.shiftKey && (!inside || active === last)) {
      event.preventDefault();
      first.focus();
    }
  }

  function liveStatus(state) {
    document.body.dataset.live = state;
    var dot = document.getElementById("live-status");
    if (dot) {
      dot.className = "live live-" + state;
      dot.textContent = state === "open" ? "live" : state === "closed" ? "reconnecting"
        : state === "signed-out" ? "signed out: reload to sign in"
        : state === "gone" ? "updates stopped: reload" : "";
      dot.title = state === "open" ? "Updates arrive without reloading"
        : state === "signed-out" ? "Your session ended; reloading this page signs you in again and brings you back here"
        : state === "gone" ? "What this page shows was deleted, or is no longer yours to see; reloading says which"
        : "Live updates paused; reconnecting";
    }
  }
  // A form's buttons rest while its request is on its way: a double click sent two requests
  // (and "Trigger now" made two runs).
  // Only for actions (POST): a form's own previews (GET, as one types) leave them be.
  function posting(event) {
    var form = event.detail.elt, config = event.detail.requestConfig || {};
    return form && form.tagName === "FORM" && String(config.verb).toLowerCase() === "post" ? form : null;
  }
  document.addEventListener("htmx:beforeRequest", function (event) {
    var form = posting(event);
    if (!form) return;
    form.querySelectorAll("button:not([type=button]):not(:disabled)").forEach(function (button) {
      button.disabled = true;
      button.dataset.busy = "true";
    });
  });
  document.addEventListener("htmx:afterRequest", function (event) {
    var form = posting(event);
    if (!form) return;
    form.querySelectorAll("button[data-busy]").forEach(function (button) {
      button.disabled = false;
      delete button.dataset.busy;
    });
  });

  // A live update waits while an action is on its way: it replaced the form that sent it, and
  // the action's answer went to the replaced form, where nothing hears it (a refusal said
  // nothing; the form's buttons were live again mid-request). When the last action has its
  // answer, the page asks the server for the page as it is now (apps/dashboard/consumers.py).
  var actions = new Map();  // request → when it was sent
  var heldSocket = null;
  var ACTION_LONGEST_MS = 30000;  // an answer never heard of stops holding updates after this
  function isAction(event) {
    var config = event.detail.requestConfig || {};
    return String(config.verb).toLowerCase() === "post" && event.detail.xhr;
  }
  document.addEventListener("htmx:beforeRequest", function (event) {
    if (isAction(event)) actions.set(event.detail.xhr, Date.now());
  });
  document.addEventListener("htmx:afterRequest", function (event) {
    if (!isAction(event) || !actions.delete(event.detail.xhr) || actions.size) return;
    delete document.body.dataset.liveHeld;
    var xhr = event.detail.xhr;
    var leaving = xhr.getResponseHeader && (xhr.getResponseHeader("HX-Redirect") ||
      xhr.getResponseHeader("HX-Refresh"));  // the next page is the page as it is now
    if (heldSocket && !leaving) heldSocket.send(JSON.stringify({ again: true }));
    heldSocket = null;
  });
  document.addEventListener("htmx:wsBeforeMessage", function (event) {
    var now = Date.now();
    actions.forEach(function (sent, request) {
      if (now - sent > ACTION_LONGEST_MS) actions.delete(request);
    });
    if (!actions.size) return;
    event.preventDefault();
    event.stopImmediatePropagation();
    heldSocket = event.detail.socketWrapper;
    document.body.dataset.liveHeld = "true";
  });

  // htmx swaps nothing for an error answer: without this, a refused action (403, 404, 409, a
  // 500) looked like a click that did nothing. The error page's own words are shown instead.
  function say(text) {
    var list = document.getElementById("messages");
    if (!list) {
      list = document.createElement("ul");
      list.className = "messages";
      list.id = "messages";
      var main = document.querySelector("main");
      if (!main) return;
      main.insertBefore(list, main.firstChild);
    }
    var item = document.createElement("li");
    item.className = "error";
    item.setAttribute("role", "alert");
    item.textContent = text;
    list.appendChild(item);
  }
  // A form larger than the server reads is refused unread (413), and a plain form's input
  // lost with the page: it is stopped here, its input kept. Captured before htmx sees it.
  function sizeOver(form) {
    var limit = Number(document.body.dataset.maxBody || 0);
    var size = limit ? new URLSearchParams(new FormData(form)).toString().length : 0;
    return size > limit ? size : 0;
  }
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!form || form.tagName !== "FORM" || form.method.toLowerCase() !== "post") return;
    var size = sizeOver(form);
    if (!size) return;
    event.preventDefault();
    event.stopPropagation();
    say("Not sent: the form is " + size + " bytes, more than the " +
        document.body.dataset.maxBody + " the server takes. What you typed is kept.");
  }, true);
  // A form's check of its fields as they are typed (`data-form-check`) is not sent either: its
  // 413 was said as if the form had been.
  document.addEventListener("htmx:beforeRequest", function (event) {
    var elt = event.detail.elt, form = elt && elt.closest && elt.closest("form");
    if (form && elt.hasAttribute("data-form-check") && sizeOver(form)) event.preventDefault();
  });

  // A form sent after the session ended (it expired, or another tab signed out) lands on the
  // sign-in page, and what was typed was lost. A form marked `data-keep-draft` keeps what it
  // sends in the tab (sessionStorage), and puts it back when the reader comes back to it from
  // signing in again; any other page after it (the saved job's) forgets it. It is put back
  // only for the person who typed it (another could sign in on the same page), and an edit
  // form's only over the version of the job it was typed on.
  var DRAFT_LONGEST_MS = 12 * 3600 * 1000;  // the session's own default lifetime
  function draftKey(form) { return "draft:" + location.pathname + "#" + form.id; }
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!form.matches || !form.matches("form[data-keep-draft]")) return;
    var fields = [];
    new FormData(form).forEach(function (value, name) {
      if (name !== "csrfmiddlewaretoken" && typeof value === "string") fields.push([name, value]);
    });
    var draft = { at: Date.now(), user: document.body.dataset.user || "", fields: fields };
    try {
      sessionStorage.setItem(draftKey(form), JSON.stringify(draft));
    } catch (e) { /* storage full or refused: the form is sent as before */ }
  }, true);
  function restoreDrafts() {
    var signIn = document.body.dataset.signIn || "";
    if (signIn && location.pathname === signIn) return;  // on the way back to the form
    var kept = {};
    document.querySelectorAll("form[data-keep-draft]").forEach(function (form) {
      kept[draftKey(form)] = form;
    });
    var fromSignIn = false;
    try { fromSignIn = !!signIn && new URL(document.referrer).pathname === signIn; } catch (e) { /* none */ }
    for (var i = sessionStorage.length - 1; i >= 0; i--) {
      var key = sessionStorage.key(i);
      if (!key || key.indexOf("draft:") !== 0) continue;
      var raw = sessionStorage.getItem(key);
      sessionStorage.removeItem(key);
      if (kept[key] && fromSignIn) putBack(kept[key], JSON.parse(raw));
    }
  }
  function putBack(form, draft) {
    if (!draft || Date.now() - draft.at > DRAFT_LONGEST_MS) return;
    if (!draft.user || draft.user !== document.body.dataset.user) return;
    var values = {};
    draft.fields.forEach(function (pair) { (values[pair[0]] = values[pair[0]] || []).push(pair[1]); });
    var seen = form.querySelector("input[name=seen]");
    var note = document.createElement("p");
    note.className = "callout draft-note";
    note.setAttribute("role", "status");
    if (seen && values.seen && values.seen[0] !== seen.value) {
      note.textContent = "What you typed before signing in again was not put back: the job " +
        "changed meanwhile (its audit trail says how). Type it again over the job as it is.";
      form.insertBefore(note, form.firstChild);
      return;
    }
    var changed = [];
    Array.prototype.forEach.call(form.elements, function (field) {
      if (!field.name || field.disabled || field.type === "hidden" || field.type === "submit") return;
      var sent = values[field.name] || [];
      if (field.type === "checkbox" || field.type === "radio") {
        var checked = sent.indexOf(field.value) >= 0;
        if (field.checked !== checked) { field.checked = checked; changed.push(field); }
      } else if (sent.length && field.value !== sent[0]) {
        field.value = sent[0];
        changed.push(field);
      }
    });
    note.textContent = "What you typed before signing in again is back in the form; nothing is " +
      "saved until you save it.";
    form.insertBefore(note, form.firstChild);
    changed.forEach(function (field) {  // what follows a field (the schedule's preview)
      field.dispatchEvent(new Event("change", { bubbles: true }));
    });
  }
  try { restoreDrafts(); } catch (e) { /* sessionStorage unavailable: nothing was kept */ }

  document.addEventListener("htmx:responseError", function (event) {
    var xhr = event.detail.xhr;
    var page = new DOMParser().parseFromString(xhr.responseText || "", "text/html");
    var title = page.querySelector("main h1, h1");
    var why = page.querySelector("main h1 + p, h1 + p");
    var text = [title && title.textContent.trim(), why && why.textContent.trim()].filter(Boolean).join(": ");
    say(text || "The request failed (" + xhr.status + "); nothing was changed.");
    var dialog = document.getElementById("dialog");
    if (dialog) dialog.innerHTML = "";
  });
  document.addEventListener("htmx:sendError", function () {
    say("The dashboard could not be reached; try again.");
  });

  document.addEventListener("htmx:wsOpen", function () { liveStatus("open"); });
  // 4401: the server closed the socket because the session ended; 4404: because what the
  // page shows was deleted or is no longer the user's (apps/dashboard/consumers.py; it said
  // "signed out" for both). "reconnecting" would never end.
  document.addEventListener("htmx:wsClose", function (event) {
    var code = event.detail && event.detail.event ? event.detail.event.code : 0;
    liveStatus(code === 4401 ? "signed-out" : code === 4404 ? "gone" : "closed");
  });
  document.addEventListener("htmx:wsAfterMessage", function () {
    document.body.dataset.liveUpdates = String(Number(document.body.dataset.liveUpdates || 0) + 1);
  });

  // A live update replaces a list whole, and new runs arrive at its top: a reader scrolled
  // down the list found another run where they were reading. The first row in view (rows
  // carry ids) is put back where it was, or, when it has left the list, the first of the
  // rows below it that is still there; rows that were not there before are marked as new.
  // The focus goes back to the same link or button of the same row (a keyboard reader was
  // sent to the top of the page), and a ticked run that the update pushed off the page stays
  // ticked, as a hidden field of the form, with a note that says so.
  var reading = null;
  function focusIn() {
    var active = document.activeElement, row = active && active.closest && active.closest("tr[id]");
    if (!row) return null;
    var parts = Array.prototype.slice.call(row.querySelectorAll("a, button, input, select"));
    return { row: row.id, index: parts.indexOf(active) };
  }
  function ticked() {
    var ids = [];
    document.querySelectorAll("#bulk-form input[name=ids]").forEach(function (box) {
      if (box.type === "hidden" || box.checked) ids.push(box.value);
    });
    return ids;
  }
  function keepTicked(ids) {
    var form = document.getElementById("bulk-form");
    if (!form || !ids.length) return;
    var gone = ids.filter(function (id) {
      var box = form.querySelector("input[type=checkbox][name=ids][value='" + id + "']");
      if (box) box.checked = true;
      return !box;
    });
    selectAllSays(form);
    if (!gone.length) return;
    gone.forEach(function (id) {
      var kept = document.createElement("input");
      kept.type = "hidden";
      kept.name = "ids";
      kept.value = id;
      form.appendChild(kept);
    });
    var bar = form.querySelector(".bulkbar");
    if (!bar) return;
    var note = document.createElement("span");
    note.className = "hint kept-ticked";
    note.setAttribute("role", "status");
    note.textContent = gone.length + (gone.length === 1 ? " ticked run is" : " ticked runs are") +
      " no longer on this page and stay" + (gone.length === 1 ? "s" : "") + " selected. ";
    var clear = document.createElement("button");
    clear.type = "button";
    clear.className = "btn";
    clear.textContent = "Unselect " + (gone.length === 1 ? "it" : "them");
    clear.addEventListener("click", function () {
      form.querySelectorAll("input[type=hidden][name=ids]").forEach(function (kept) { kept.remove(); });
      note.remove();
    });
    note.appendChild(clear);
    bar.appendChild(note);
  }
  function rowsInView() {
    return Array.prototype.filter.call(document.querySelectorAll("tr[id]"), function (row) {
      return row.getBoundingClientRect().bottom > 0;
    });
  }
  document.addEventListener("htmx:wsBeforeMessage", function () {
    var rows = document.querySelectorAll("tr[id]");
    var seen = {};
    rows.forEach(function (row) { seen[row.id] = true; });
    var below = window.scrollY > 0 ? rowsInView() : [];
    reading = {
      focus: focusIn(),
      ticked: ticked(),
      seen: rows.length ? seen : null,
      places: below.slice(0, 20).map(function (row) {
        return { id: row.id, top: row.getBoundingClientRect().top };
      }),
    };
  });
  document.addEventListener("htmx:wsAfterMessage", function () {
    var was = reading;
    reading = null;
    if (!was) return;
    keepTicked(was.ticked);
    if (was.focus && document.activeElement === document.body) {
      var again = document.getElementById(was.focus.row);
      var parts = again ? again.querySelectorAll("a, button, input, select") : [];
      if (parts[was.focus.index]) parts[was.focus.index].focus({ preventScroll: true });
    }
    for (var i = 0; i < was.places.length; i++) {
      var row = document.getElementById(was.places[i].id);
      if (row) {
        window.scrollBy(0, row.getBoundingClientRect().top - was.places[i].top);
        break;
      }
    }
    if (!was.seen) return;  // the list's first rows: nothing is new to the reader
    document.querySelectorAll("tr[id]").forEach(function (row) {
      if (!was.seen[row.id]) row.classList.add("arrived");
    });
  });
})();

// Times: every `<time data-when>` (the `when` template tag) shows the reader's local time with
// its zone, the ISO instant on hover, and an age ("3 min ago") that keeps counting. The age is
// measured against the server's clock (the page's `data-server-now`), not the reader's.
(function () {
  "use strict";
  var skew = 0;
  var stamp = document.body && document.body.dataset.serverNow;
  if (stamp && !isNaN(Date.parse(stamp))) skew = Date.parse(stamp) - Date.now();

  function two(n) { return (n < 10 ? "0" : "") + n; }
  function zoneName(date) {
    try {
      var parts = new Intl.DateTimeFormat(undefined, { timeZoneName: "short" }).formatToParts(date);
      for (var i = 0; i < parts.length; i++) if (parts[i].type === "timeZoneName") return parts[i].value;
    } catch (e) { /* an old browser: the offset below */ }
    var offset = -date.getTimezoneOffset();
    return "UTC" + (offset >= 0 ? "+" : "-") + two(Math.floor(Math.abs(offset) / 60)) + ":" + two(Math.abs(offset) % 60);
  }
  function local(date, short) {
    var time = two(date.getHours()) + ":" + two(date.getMinutes()) + ":" + two(date.getSeconds());
    var day = date.getFullYear() + "-" + two(date.getMonth() + 1) + "-" + two(date.getDate());
    return (short ? time : day + " " + time) + " " + zoneName(date);
  }
  function age(ms) {
    var s = Math.floor(Math.abs(ms) / 1000), text;
    if (s < 60) text = s + " s";
    else if (s < 3600) text = Math.floor(s / 60) + " min";
    else if (s < 86400) text = Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    else text = Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
    return ms < 0 ? "in " + text : text + " ago";
  }
  function refresh(root) {
    var now = Date.now() + skew;
    (root || document).querySelectorAll("time[data-when]").forEach(function (el) {
      var at = Date.parse(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      var date = new Date(at);
      if (!el.dataset.localised) {
        el.textContent = local(date, el.dataset.when === "short");
        el.dataset.localised = "1";
      }
      var next = el.nextElementSibling;
      if (next && next.classList.contains("age")) next.textContent = age(now - at);
    });
  }
  // A filter's times are typed in the reader's zone, as the page shows them: its form says
  // which (`tz`), unless it came with one (a shared link keeps the zone it was made in). A
  // link with times and no zone was read in UTC, and says so: it keeps meaning that.
  function zones(root) {
    var mine;
    try { mine = Intl.DateTimeFormat().resolvedOptions().timeZone; } catch (e) { mine = ""; }
    (root || document).querySelectorAll("input[data-zone-input]").forEach(function (input) {
      var form = input.form;
      if (!form) return;
      if (!input.value) {
        var typed = Array.prototype.some.call(
          form.querySelectorAll("input[type=datetime-local]"), function (field) { return field.value; });
        input.value = typed ? "UTC" : mine;
      }
      if (!input.value) return;
      form.querySelectorAll("[data-zone-name]").forEach(function (name) {
        name.textContent = input.value;
      });
    });
  }
  document.addEventListener("DOMContentLoaded", function () { refresh(); zones(); });
  document.addEventListener("htmx:afterSwap", function (event) {
    refresh(event.target);
    zones(event.target);
  });
  document.addEventListener("htmx:wsAfterMessage", function () { refresh(); });
  setInterval(refresh, 5000);
  if (document.readyState !== "loading") { refresh(); zones(); }
})();

// Narrow screens: the sections fold behind the "Menu" button (CSS shows it below 700 px).
(function () {
  "use strict";
  var top = document.querySelector("header.top");
  var toggle = top && top.querySelector(".menu-toggle");
  if (!toggle) return;
  top.classList.add("foldable");
  toggle.addEventListener("click", function () {
    var open = top.classList.toggle("open");
    toggle.setAttribute("aria-expanded", String(open));
  });
})();
