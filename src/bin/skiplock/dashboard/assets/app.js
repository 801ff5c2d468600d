// skiplock dashboard: confirmations, the live overview and the live chart.
// Plain JavaScript with no dependency, served by the dashboard itself (works offline).
(function () {
  "use strict";

  // Every action form asks before it posts. The server asks again (with a page of its
  // own) unless the form says confirmed=yes, so nothing happens without a confirmation.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    var question = form.getAttribute("data-confirm");
    if (!question) return;
    if (!window.confirm(question)) {
      event.preventDefault();
      return;
    }
    var field = form.querySelector("input[name=confirmed]");
    if (field) field.value = "yes";
  });

  // Runs fn (which returns a promise) now and then every `ms`, while the tab is visible.
  function every(ms, fn) {
    function tick() {
      var done = function () { setTimeout(tick, ms); };
      if (document.hidden) { done(); return; }
      fn().then(done, done);
    }
    tick();
  }

  function get(url, accept) {
    return fetch(url, { credentials: "same-origin", headers: { Accept: accept } })
      .then(function (response) {
        if (!response.ok) throw new Error(url + ": " + response.status);
        return response;
      });
  }

  // The overview's numbers: server-rendered fragments fetched again every 5 seconds.
  Array.prototype.forEach.call(document.querySelectorAll(".live[data-src]"), function (live) {
    setTimeout(function () {
      every(5000, function () {
        return get(live.dataset.src, "text/html")
          .then(function (response) { return response.text(); })
          .then(function (html) {
            live.innerHTML = html;
            live.classList.remove("stale");
          })
          .catch(function () { live.classList.add("stale"); });
      });
    }, 5000);
  });

  // The live chart: successes and failed attempts per second over the last hour. The
  // first request fetches the hour, later ones the last few seconds (which may still grow
  // while transactions commit), so each refresh stays cheap.
  var chart = document.getElementById("throughput-chart");
  if (chart && chart.dataset.src) {
    var WINDOW = 3600;
    var OVERLAP = 10;
    var succeeded = new Map();
    var failed = new Map();
    var now = null;

    var refresh = function () {
      var url = chart.dataset.src + (now === null ? "" : "?since=" + (now - OVERLAP));
      return get(url, "application/json")
        .then(function (response) { return response.json(); })
        .then(function (data) {
          if (now !== null) {
            for (var s = now - OVERLAP + 1; s <= data.now; s++) {
              succeeded.delete(s);
              failed.delete(s);
            }
          }
          data.succeeded.forEach(function (p) { succeeded.set(p[0], p[1]); });
          data.failed.forEach(function (p) { failed.set(p[0], p[1]); });
          now = data.now;
          [succeeded, failed].forEach(function (map) {
            map.forEach(function (_, second) { if (second <= now - WINDOW) map.delete(second); });
          });
          draw();
          chart.classList.remove("stale");
        })
        .catch(function () { chart.classList.add("stale"); });
    };

    var total = function (map) {
      var sum = 0;
      map.forEach(function (n) { sum += n; });
      return sum;
    };

    // Rates per second, averaged over steps of a few seconds so that one point gets a
    // few pixels: raw per-second counts of a busy queue would draw a solid block.
    var rates = function (map, start, step) {
      var points = [];
      for (var from = start; from < now; from += step) {
        var sum = 0;
        for (var s = from + 1; s <= Math.min(from + step, now); s++) sum += map.get(s) || 0;
        points.push([from + step / 2, sum / step]);
      }
      return points;
    };

    var draw = function () {
      var width = Math.max(chart.clientWidth || 900, 300);
      var height = 200, left = 44, right = 8, top = 10, bottom = 22;
      var plotW = width - left - right, plotH = height - top - bottom;
      var start = now - WINDOW;
      var step = Math.max(1, Math.ceil(WINDOW / (plotW / 3)));
      var ok = rates(succeeded, start, step);
      var bad = rates(failed, start, step);
      var max = 0;
      ok.concat(bad).forEach(function (p) { if (p[1] > max) max = p[1]; });
      max = max > 0 ? max * 1.1 : 1;
      var x = function (second) { return left + ((second - start) / WINDOW) * plotW; };
      var y = function (rate) { return top + plotH - (rate / max) * plotH; };
      var line = function (points) {
        return points.map(function (p, i) {
          return (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1);
        }).join("");
      };
      var area = function (points) {
        if (!points.length) return "";
        return line(points) + "L" + x(points[points.length - 1][0]).toFixed(1) + " " + y(0) +
          "L" + x(points[0][0]).toFixed(1) + " " + y(0) + "Z";
      };
      var ticks = "";
      [[start, "-60 min"], [start + WINDOW / 2, "-30 min"], [now, "now"]].forEach(function (t, i) {
        var anchor = i === 0 ? "start" : i === 2 ? "end" : "middle";
        ticks += '<text class="tick" x="' + x(t[0]).toFixed(1) + '" y="' + (height - 6) +
          '" text-anchor="' + anchor + '">' + t[1] + "</text>";
      });
      var label = (max < 10 ? max.toFixed(1) : Math.round(max)) + "/s";
      chart.innerHTML =
        '<svg viewBox="0 0 ' + width + " " + height + '" role="img" ' +
        'aria-label="Succeeded and failed per second, last hour">' +
        '<line class="axis" x1="' + left + '" y1="' + (top + plotH) + '" x2="' + (width - right) +
        '" y2="' + (top + plotH) + '"></line>' +
        '<text class="tick" x="' + (left - 6) + '" y="' + (top + 4) + '" text-anchor="end">' + label + "</text>" +
        '<text class="tick" x="' + (left - 6) + '" y="' + (top + plotH) + '" text-anchor="end">0</text>' +
        '<text class="tick" x="' + (width - right) + '" y="' + (top + 4) + '" text-anchor="end">' +
        "averaged over " + step + " s</text>" +
        ticks +
        '<path class="succeeded-area" d="' + area(ok) + '"></path>' +
        '<path class="succeeded" d="' + line(ok) + '"></path>' +
        '<path class="failed" d="' + line(bad) + '"></path>' +
        "</svg>";
      var s = document.getElementById("succeeded-total");
      var f = document.getElementById("failed-total");
      if (s) s.textContent = "(" + total(succeeded) + " in the hour)";
      if (f) f.textContent = "(" + total(failed) + " in the hour)";
      chart.dataset.ready = "true";
    };

    every(2000, refresh);
    window.addEventListener("resize", function () { if (now !== null) draw(); });
  }
})();
