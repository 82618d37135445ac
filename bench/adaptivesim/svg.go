package main

import (
	"bytes"
	"fmt"
	"time"
)

// Plot geometry: one panel per controller with a limit, stacked, sharing the
// time axis and the limit scale.
const (
	plotWidth   = 1000.0
	panelHeight = 150.0
	panelGap    = 44.0
	marginLeft  = 56.0
	marginRight = 16.0
	marginTop   = 74.0
	marginBot   = 44.0
)

var colors = []string{"#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"}

// PlotSVG draws the limit over time of every controller that has one in
// scenario sc, from the same runs as the table: the target band and the
// servers in force behind each.
func PlotSVG(sc *Scenario, results []*Result) []byte {
	var rows []*Result
	for _, r := range results {
		if r.Scenario.Name == sc.Name && r.Kind != Reference {
			rows = append(rows, r)
		}
	}
	end := 3 * sc.Phase
	yMax := float64(maxLimit)
	plotW := plotWidth - marginLeft - marginRight
	height := marginTop + float64(len(rows))*(panelHeight+panelGap) - panelGap + marginBot

	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" font-family="sans-serif" font-size="12">`+"\n",
		plotWidth, height, plotWidth, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	title := "open loop: Poisson arrivals at %.2g× capacity"
	arg := any(sc.Load)
	if !sc.Open {
		title, arg = "closed loop: %d clients back to back", sc.Clients
	}
	fmt.Fprintf(&b, `<text x="%.0f" y="20" font-size="15" font-weight="bold">Concurrency limit over time — `+title+`</text>`+"\n", marginLeft, arg)
	lo, hi := band(sc.Servers)
	fmt.Fprintf(&b, `<text x="%.0f" y="40" fill="#444">c = %d servers, c/2 from %gs to %gs; green: target band [0.8c, 2.2c] = [%.0f, %.0f] at c; dashed: servers in force (the oracle's limit)</text>`+"\n",
		marginLeft, sc.Servers, sc.Phase.Seconds(), 2*sc.Phase.Seconds(), lo, hi)

	x := func(t time.Duration) float64 { return marginLeft + plotW*float64(t)/float64(end) }
	for i, r := range rows {
		top := marginTop + float64(i)*(panelHeight+panelGap)
		y := func(v float64) float64 { return top + panelHeight*(1-min(v, yMax)/yMax) }

		// Band and servers in force, phase by phase.
		for p := range 3 {
			t0, t1 := time.Duration(p)*sc.Phase, time.Duration(p+1)*sc.Phase
			c := sc.serversAt(t0)
			blo, bhi := band(c)
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="#2ca02c" fill-opacity="0.12"/>`+"\n",
				x(t0), y(bhi), x(t1)-x(t0), y(blo)-y(bhi))
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#555" stroke-dasharray="5,4"/>`+"\n",
				x(t0), y(float64(c)), x(t1), y(float64(c)))
		}
		// Axes, grid and ticks.
		for v := 0.0; v <= yMax; v += 50 {
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", marginLeft, y(v), marginLeft+plotW, y(v))
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end" fill="#444">%.0f</text>`+"\n", marginLeft-6, y(v)+4, v)
		}
		step := tickStep(end)
		for t := time.Duration(0); t <= end; t += step {
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#999"/>`+"\n", x(t), top+panelHeight, x(t), top+panelHeight+4)
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#444">%gs</text>`+"\n", x(t), top+panelHeight+16, t.Seconds())
		}
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="none" stroke="#888"/>`+"\n", marginLeft, top, plotW, panelHeight)

		color := colors[i%len(colors)]
		fmt.Fprintf(&b, `<path d="%s" fill="none" stroke="%s" stroke-width="1.3" stroke-linejoin="round"/>`+"\n",
			limitPath(r.Trace.Limit, end, plotW, x, y), color)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" font-size="13" fill="#444"><tspan font-weight="bold" fill="%s">%s</tspan>  %s</text>`+"\n",
			marginLeft, top-7, color, r.Controller, r.Desc)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end" fill="#444">goodput %.1f%%, p99 %s; steady limit %s at c, %s at c/2</text>`+"\n",
			marginLeft+plotW, top-7, 100*r.Goodput, ms(r.P99), limitRange(r, 0), limitRange(r, 1))
		fmt.Fprintf(&b, `<text transform="translate(14 %.1f) rotate(-90)" text-anchor="middle" fill="#444">limit</text>`+"\n", top+panelHeight/2)
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" fill="#444">virtual time</text>`+"\n", marginLeft+plotW/2, height-8)
	b.WriteString("</svg>\n")
	return b.Bytes()
}

// limitPath draws a step function of the limit, reduced to the least and
// greatest value per horizontal pixel so that a limit that moves every few
// milliseconds still draws as its envelope, not as aliasing.
func limitPath(pts []point, end time.Duration, plotW float64, x func(time.Duration) float64, y func(float64) float64) string {
	cols := int(plotW)
	var b bytes.Buffer
	i := 0
	prev := pts[0].limit
	for col := range cols {
		t0 := time.Duration(float64(end) * float64(col) / float64(cols))
		t1 := time.Duration(float64(end) * float64(col+1) / float64(cols))
		lo, hi, first := prev, prev, prev
		for i < len(pts) && pts[i].t < t1 {
			if pts[i].t >= t0 {
				lo, hi = min(lo, pts[i].limit), max(hi, pts[i].limit)
			} else {
				first, lo, hi = pts[i].limit, pts[i].limit, pts[i].limit
			}
			prev = pts[i].limit
			i++
		}
		cmd := "L"
		if col == 0 {
			cmd = "M"
		}
		fmt.Fprintf(&b, "%s%.1f %.1f", cmd, x(t0), y(float64(first)))
		if lo != hi {
			fmt.Fprintf(&b, "L%.1f %.1fL%.1f %.1f", x(t0), y(float64(lo)), x(t0), y(float64(hi)))
		}
		fmt.Fprintf(&b, "L%.1f %.1f", x(t1), y(float64(prev)))
	}
	return b.String()
}

// tickStep picks a time-axis step giving about ten ticks.
func tickStep(end time.Duration) time.Duration {
	for _, s := range []time.Duration{time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second, 20 * time.Second, 30 * time.Second, time.Minute} {
		if end/s <= 12 {
			return s
		}
	}
	return 2 * time.Minute
}
