// The dashboard's only script of its own (the CSP allows no inline script). Everything works
// without it; it adds "select all", closing the confirmation dialog, and the live indicator.
(function () {
  "use strict";

  document.addEventListener("change", function (event) {
    var box = event.target;
    if (!box.matches || !box.matches("[data-select-all]")) return;
    var form = box.form || box.closest("form");
    if (!form) return;
    form.querySelectorAll("input[type=checkbox][name=ids]").forEach(function (item) {
      item.checked = box.checked;
    });
  });

  document.addEventListener("click", function (event) {
    var close = event.target.closest && event.target.closest("[data-close-dialog]");
    if (!close) return;
    var dialog = document.getElementById("dialog");
    if (dialog) {
      event.preventDefault();
      dialog.innerHTML = "";
    }
  });

  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
    var dialog = document.getElementById("dialog");
    if (dialog) dialog.innerHTML = "";
  });

  function liveStatus(state) {
    document.body.dataset.live = state;
    var dot = document.getElementById("live-status");
    if (dot) {
      dot.className = "live live-" + state;
      dot.textContent = state === "open" ? "live" : state === "closed" ? "reconnecting" : "";
      dot.title = state === "open" ? "Updates arrive without reloading" : "Live updates paused; reconnecting";
    }
  }
  document.addEventListener("htmx:wsOpen", function () { liveStatus("open"); });
  document.addEventListener("htmx:wsClose", function () { liveStatus("closed"); });
  document.addEventListener("htmx:wsAfterMessage", function () {
    document.body.dataset.liveUpdates = String(Number(document.body.dataset.liveUpdates || 0) + 1);
  });
})();
