// A small live line chart on a <canvas>: a few named series of (time, value) points over a
// sliding time span (growing from 30 s to the full span while the page is young), y from 0 to a
// rounded maximum, drawn at the device's pixel ratio.

const NICE = [1, 2, 2.5, 5, 10];
const MIN_SPAN_MS = 30 * 1000;

function niceMax(value) {
  if (!(value > 0)) return 1;
  const exponent = Math.floor(Math.log10(value));
  const base = 10 ** exponent;
  for (const step of NICE) if (step * base >= value) return step * base;
  return 10 * base;
}

function label(value) {
  if (value >= 100) return value.toFixed(0);
  if (value >= 10) return value.toFixed(1).replace(/\.0$/, "");
  return String(+value.toPrecision(2));
}

export class LineChart {
  constructor(canvas, series, spanMs) {
    this.canvas = canvas;
    this.series = series; // [{name, color}]
    this.spanMs = spanMs;
    this.points = []; // [{t, values: [number|null, ...]}]
  }

  push(t, values) {
    this.points.push({ t, values });
    while (this.points.length && this.points[0].t < t - this.spanMs) this.points.shift();
    this.draw(t);
  }

  draw(now) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 34, right = 6, top = 6, bottom = 14;
    const plotW = width - left - right, plotH = height - top - bottom;
    let max = 0;
    for (const p of this.points) for (const v of p.values) if (v != null && v > max) max = v;
    max = niceMax(max);
    const style = getComputedStyle(canvas);
    ctx.font = "10px " + style.fontFamily;
    ctx.fillStyle = style.color;
    ctx.strokeStyle = style.borderColor || "#ccc";
    ctx.lineWidth = 1;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (const f of [0, 0.5, 1]) {
      const y = top + plotH * (1 - f);
      ctx.globalAlpha = 0.35;
      ctx.beginPath();
      ctx.moveTo(left, Math.round(y) + 0.5);
      ctx.lineTo(width - right, Math.round(y) + 0.5);
      ctx.stroke();
      ctx.globalAlpha = 1;
      ctx.fillText(label(max * f), left - 4, y);
    }
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    const span = Math.min(this.spanMs, Math.max(MIN_SPAN_MS, this.points.length ? now - this.points[0].t : 0));
    const spanText = span >= 90000 ? Math.round(span / 60000) + " min" : Math.round(span / 1000) + " s";
    ctx.fillText("-" + spanText, left, height - 2);
    ctx.textAlign = "right";
    ctx.fillText("now", width - right, height - 2);
    const x = (t) => left + plotW * (1 - (now - t) / span);
    const y = (v) => top + plotH * (1 - v / max);
    this.series.forEach((s, k) => {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let drawing = false;
      this.points.forEach((p, i) => {
        const v = p.values[k];
        if (v == null) {
          drawing = false;
          return;
        }
        if (drawing) ctx.lineTo(x(p.t), y(v));
        else ctx.moveTo(x(p.t), y(v));
        drawing = true;
        const before = this.points[i - 1], after = this.points[i + 1];
        if ((!before || before.values[k] == null) && (!after || after.values[k] == null)) {
          ctx.fillStyle = s.color; // a lone point: a dot, since a line needs two
          ctx.fillRect(x(p.t) - 1.5, y(v) - 1.5, 3, 3);
        }
      });
      ctx.stroke();
    });
  }
}
