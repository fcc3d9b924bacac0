// Live regions: each page with a `data-live` URL subscribes to it (server-sent events) and
// swaps in each new rendering of its region, unless the operator is typing in it.
(function () {
  "use strict";
  var region = document.getElementById("live");
  var url = document.body.getAttribute("data-live");
  if (!region || !url || !window.EventSource) return;
  var status = document.getElementById("live-status");
  var source = new EventSource(url);
  source.addEventListener("open", function () {
    if (status) { status.textContent = "live"; status.className = "live on"; }
  });
  source.addEventListener("error", function () {
    if (status) { status.textContent = "reconnecting"; status.className = "live off"; }
  });
  source.addEventListener("fragment", function (event) {
    var update = JSON.parse(event.data);
    var target = document.getElementById(update.id);
    if (!target) return;
    var focused = document.activeElement;
    if (focused && focused !== document.body && target.contains(focused)) return;
    target.innerHTML = update.html;
    document.body.setAttribute("data-updated", String(Date.now()));
  });
  // confirmations the CLI asks as questions
  document.addEventListener("submit", function (event) {
    var question = event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) event.preventDefault();
  });
})();
