"""Small server-rendered SVG charts: no script, no CDN, no inline style (the CSP forbids both)."""

from __future__ import annotations

from collections.abc import Sequence

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

WIDTH = 600
HEIGHT = 120
AXIS = 16  # room for the labels under the bars


def _scale(peak: int) -> int:
    return max(peak, 1)


def bar_chart(
    series: Sequence[Sequence[int]],
    labels: Sequence[str],
    *,
    title: str,
    classes: Sequence[str],
    tick_every: int,
) -> SafeString:
    """Stacked bars, one per label; `series[k][i]` is layer k of bar i (drawn bottom up).

    Each bar carries a <title> ("14:00 · 3 failed") so hovering reads the exact figure.
    """
    count = len(labels)
    slot = WIDTH / max(count, 1)
    bar = max(slot - 2, 1)
    plot = HEIGHT - AXIS
    totals = [sum(layer[i] for layer in series) for i in range(count)]
    top = _scale(max(totals, default=0))
    rects = []
    for i in range(count):
        y = float(plot)
        for layer, css in zip(series, classes, strict=True):
            value = layer[i]
            if not value:
                continue
            h = max(plot * value / top, 1.0)
            y -= h
            rects.append(
                (
                    f"{i * slot + 1:.1f}",
                    f"{y:.1f}",
                    f"{bar:.1f}",
                    f"{h:.1f}",
                    css,
                    f"{labels[i]} · {value}",
                )
            )
    ticks = [(f"{i * slot + slot / 2:.1f}", labels[i]) for i in range(0, count, max(tick_every, 1))]
    return format_html(
        '<svg class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{title}">'
        "<title>{title}</title>"
        '<line class="axis" x1="0" y1="{plot}" x2="{w}" y2="{plot}"/>'
        '<text class="peak" x="2" y="10">{top}</text>'
        "{rects}{ticks}</svg>",
        w=WIDTH,
        h=HEIGHT,
        plot=plot,
        title=title,
        top=max(totals, default=0),
        rects=format_html_join(
            "",
            '<rect x="{}" y="{}" width="{}" height="{}" class="{}"><title>{}</title></rect>',
            rects,
        ),
        ticks=format_html_join(
            "",
            '<text class="tick" x="{}" y="' + str(HEIGHT - 3) + '" text-anchor="middle">{}</text>',
            ticks,
        ),
    )


def meter(value: float, peak: float) -> SafeString:
    """A one-line bar for a table cell (state counts, queue depth)."""
    width = 0 if peak <= 0 else max(100 * value / peak, 1 if value else 0)
    return format_html(
        '<svg class="meter" viewBox="0 0 100 8" preserveAspectRatio="none" aria-hidden="true">'
        '<rect x="0" y="0" width="{}" height="8"/></svg>',
        f"{width:.1f}",
    )
