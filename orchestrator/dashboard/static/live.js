// skyresume dashboard: refreshes a page's live section without reloading the page.
// The section names its own URL (data-live) and period (data-every, ms); the server
// renders the fragment (every outside string escaped there), so this file only swaps
// it in. No inline script and no eval: the page's CSP allows this file alone.
// Without JavaScript the page refreshes itself instead (<noscript> meta refresh).
(function () {
  "use strict";
  var box = document.getElementById("live");
  if (!box || !box.dataset.live) return;
  var every = Number(box.dataset.every) || 2000;
  var busy = false;
  var timer = null;

  function finished() {
    return box.querySelector("[data-final]") !== null;
  }

  function refresh() {
    if (busy || document.hidden) return;
    busy = true;
    fetch(box.dataset.live, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (r) {
        if (r.redirected || !r.ok) {
          // Logged out (the login form answered) or the job is gone: stop, and say so.
          clearInterval(timer);
          box.setAttribute("data-stale", "1");
          return null;
        }
        return r.text();
      })
      .then(function (html) {
        if (html === null) return;
        box.innerHTML = html;
        box.setAttribute("data-updated", String(Date.now()));
        if (finished()) clearInterval(timer);
      })
      .catch(function () {
        // The service restarting: the next tick tries again.
      })
      .then(function () {
        busy = false;
      });
  }

  if (!finished()) timer = setInterval(refresh, every);
})();
