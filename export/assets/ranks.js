// The ranks page: a button per rank shows that rank's report; "show … in rank N" opens the
// departing rank's report on the call that made the departing value (export/html/ranks.py).
function showRank(r) {
  document.querySelectorAll('#gt-ranks button').forEach(function (x) { x.classList.toggle('on', x.getAttribute('data-rank') === r); });
  document.querySelectorAll('iframe').forEach(function (f) { f.classList.toggle('on', f.getAttribute('data-rank') === r); });
}
document.querySelectorAll('#gt-ranks button').forEach(function (b) {
  b.addEventListener('click', function () { showRank(b.getAttribute('data-rank')); });
});
var showDeparture = document.getElementById('gt-show-departure');
if (showDeparture) {
  showDeparture.addEventListener('click', function () {
    var r = showDeparture.getAttribute('data-goto-rank'), name = showDeparture.getAttribute('data-goto');
    showRank(r);
    var frame = document.querySelector('iframe[data-rank="' + r + '"]');
    // the report selects it once its script has run (a frame still loading is waited for)
    (function go(tries) {
      var w = frame.contentWindow;
      if (w && w.gradtrace && w.gradtrace.goTo) { w.gradtrace.goTo(name); return; }
      if (tries > 0) setTimeout(function () { go(tries - 1); }, 100);
    })(100);
  });
}
