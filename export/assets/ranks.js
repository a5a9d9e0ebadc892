document.querySelectorAll('#gt-ranks button').forEach(function (b) {
  b.addEventListener('click', function () {
    var r = b.getAttribute('data-rank');
    document.querySelectorAll('#gt-ranks button').forEach(function (x) { x.classList.toggle('on', x === b); });
    document.querySelectorAll('iframe').forEach(function (f) { f.classList.toggle('on', f.getAttribute('data-rank') === r); });
  });
});
