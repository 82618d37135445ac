package main

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Plot geometry, in pixels: one panel per controller, stacked, sharing the
// time axis; text is the 5×7 font at twice its size.
const (
	plotWidth   = 1200
	panelHeight = 150
	panelGap    = 56
	marginLeft  = 70
	marginRight = 40
	marginTop   = 84
	marginBot   = 64
	textScale   = 2
)

var (
	white    = color.RGBA{255, 255, 255, 255}
	ink      = color.RGBA{60, 60, 60, 255}
	grid     = color.RGBA{225, 225, 225, 255}
	frame    = color.RGBA{140, 140, 140, 255}
	bandFill = color.RGBA{220, 240, 220, 255}
	servers  = color.RGBA{90, 90, 90, 255}
	colors   = []color.RGBA{{214, 39, 40, 255}, {31, 119, 180, 255}, {44, 160, 44, 255}, {148, 103, 189, 255}, {140, 86, 75, 255}, {227, 119, 194, 255}}
)

// writePlots writes limit-<scenario>.png for every scenario into dir.
func writePlots(dir string, cfg Config, single, many []*Result) error {
	for _, group := range append(groups(single), groups(many)...) {
		sc := group[0].Scenario
		name := "limit-" + strings.ReplaceAll(strings.ReplaceAll(sc.Name, " ", "-"), "=", "") + ".png"
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, PlotPNG(group), 0o644); err != nil {
			return err
		}
		fmt.Println("wrote", path)
	}
	return nil
}

// canvas is an image with the few drawing operations the plots need.
type canvas struct{ *image.RGBA }

func (c canvas) rect(x0, y0, x1, y1 int, col color.RGBA) {
	for y := max(y0, 0); y < min(y1, c.Rect.Dy()); y++ {
		for x := max(x0, 0); x < min(x1, c.Rect.Dx()); x++ {
			c.SetRGBA(x, y, col)
		}
	}
}

func (c canvas) hline(x0, x1, y int, col color.RGBA, dash int) {
	for x := x0; x < x1; x++ {
		if dash == 0 || (x/dash)%2 == 0 {
			c.SetRGBA(x, y, col)
		}
	}
}

func (c canvas) vline(x, y0, y1 int, col color.RGBA) {
	if y0 > y1 {
		y0, y1 = y1, y0
	}
	for y := y0; y <= y1; y++ {
		c.SetRGBA(x, y, col)
	}
}

// text writes s with its top left at (x, y); align is -1 for left, 0 for
// centred, 1 for right.
func (c canvas) text(x, y int, s string, col color.RGBA, align int) {
	w := len(s) * 6 * textScale
	switch align {
	case 0:
		x -= w / 2
	case 1:
		x -= w
	}
	for i := range len(s) {
		g, ok := font5x7[s[i]]
		if !ok {
			g = [7]byte{0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F}
		}
		for row, bits := range g {
			for col5 := range 5 {
				if bits&(0x10>>col5) != 0 {
					c.rect(x+(i*6+col5)*textScale, y+row*textScale, x+(i*6+col5+1)*textScale, y+(row+1)*textScale, col)
				}
			}
		}
	}
}

// PlotPNG draws the limit over time of every controller with a limit in one
// scenario: the target band [c, 2.2c] and the servers in force behind each,
// the limit in force drawn as its least and greatest value per pixel, so
// that a drain probe shows as a dip.
func PlotPNG(group []*Result) []byte {
	var rows []*Result
	for _, r := range group {
		if r.Kind != Reference && r.Kind != Diagnostic && limited(r) {
			rows = append(rows, r)
		}
	}
	sc := group[0].Scenario
	end := 3 * sc.Phase
	plotW := plotWidth - marginLeft - marginRight
	height := marginTop + len(rows)*(panelHeight+panelGap) - panelGap + marginBot
	c := canvas{image.NewRGBA(image.Rect(0, 0, plotWidth, height))}
	c.rect(0, 0, plotWidth, height, white)

	what := fmt.Sprintf("Poisson arrivals at %.2gx capacity", sc.Load)
	if !sc.Open {
		what = fmt.Sprintf("%d clients back to back", sc.Clients*sc.hosts())
	}
	if sc.hosts() > 1 {
		what += fmt.Sprintf(", %d hosts: their sum", sc.hosts())
	}
	c.text(marginLeft, 12, fmt.Sprintf("Concurrency limit over time, %s: %s", sc.Name, what), ink, -1)
	c.text(marginLeft, 40, fmt.Sprintf("c = %d servers, c/2 from %gs to %gs. Green: [c, 2.2c]; dashed: servers in force.",
		sc.Servers, sc.Phase.Seconds(), 2*sc.Phase.Seconds()), ink, -1)

	x := func(t time.Duration) int { return marginLeft + int(float64(plotW)*float64(t)/float64(end)) }
	for i, r := range rows {
		top := marginTop + i*(panelHeight+panelGap)
		yMax := scaleFor(r, sc)
		y := func(v float64) int { return top + int(float64(panelHeight)*(1-min(v, yMax)/yMax)) }

		for p := range 3 {
			t0, t1 := time.Duration(p)*sc.Phase, time.Duration(p+1)*sc.Phase
			s := float64(sc.serversAt(t0))
			c.rect(x(t0), y(2.2*s), x(t1), y(s), bandFill)
		}
		for _, v := range ticks(yMax) {
			c.hline(marginLeft, marginLeft+plotW, y(v), grid, 0)
			c.text(marginLeft-8, y(v)-7, fmt.Sprint(v), ink, 1)
		}
		for p := range 3 {
			t0, t1 := time.Duration(p)*sc.Phase, time.Duration(p+1)*sc.Phase
			c.hline(x(t0), x(t1), y(float64(sc.serversAt(t0))), servers, 6)
		}
		step := tickStep(end)
		for t := time.Duration(0); t <= end; t += step {
			c.vline(x(t), top+panelHeight, top+panelHeight+4, frame)
			c.text(x(t), top+panelHeight+8, fmt.Sprintf("%gs", t.Seconds()), ink, 0)
		}
		c.hline(marginLeft, marginLeft+plotW, top, frame, 0)
		c.hline(marginLeft, marginLeft+plotW, top+panelHeight, frame, 0)
		c.vline(marginLeft, top, top+panelHeight, frame)
		c.vline(marginLeft+plotW, top, top+panelHeight, frame)

		col := colors[i%len(colors)]
		drawLimit(c, r.Trace.Limit.Points, end, plotW, x, y, col)
		c.text(marginLeft, top-22, r.Controller, col, -1)
		c.text(marginLeft+plotW, top-22, fmt.Sprintf("goodput %.1f%%, p99 %s; median %.0f at c, %.0f at c/2",
			100*r.Goodput, ms(r.P99), r.Median[0], r.Median[1]), ink, 1)
	}
	c.text(marginLeft+plotW/2, height-22, "virtual time", ink, 0)

	var b bytes.Buffer
	if err := png.Encode(&b, c); err != nil {
		panic(err) // encoding an in-memory RGBA image does not fail
	}
	return b.Bytes()
}

// drawLimit draws the limit in force as a step function reduced to its
// least and greatest value per pixel column, so that a limit that moves
// every few milliseconds draws as its envelope, not as aliasing.
func drawLimit(c canvas, pts []point, end time.Duration, plotW int, x func(time.Duration) int, y func(float64) int, col color.RGBA) {
	i, prev := 0, pts[0].limit
	lastY := y(float64(prev))
	for column := range plotW {
		t1 := time.Duration(float64(end) * float64(column+1) / float64(plotW))
		lo, hi := prev, prev
		for i < len(pts) && pts[i].t < t1 {
			lo, hi = min(lo, pts[i].limit), max(hi, pts[i].limit)
			prev = pts[i].limit
			i++
		}
		px := marginLeft + column
		c.vline(px, lastY, y(float64(lo)), col)
		c.vline(px, y(float64(lo)), y(float64(hi)), col)
		lastY = y(float64(prev))
		c.vline(px, y(float64(hi)), lastY, col)
	}
}

// scaleFor is a panel's top: 2.6c, or the greatest limit drawn, rounded up.
func scaleFor(r *Result, sc *Scenario) float64 {
	top := 2.6 * float64(sc.Servers)
	for _, pt := range r.Trace.Limit.Points {
		top = max(top, float64(pt.limit))
	}
	unit := math.Pow(10, math.Floor(math.Log10(top)))
	return math.Ceil(top/unit*2) * unit / 2
}

// ticks are four or five round values from 0 to top.
func ticks(top float64) []float64 {
	step := top / 4
	unit := math.Pow(10, math.Floor(math.Log10(step)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*unit >= step {
			step = m * unit
			break
		}
	}
	var out []float64
	for v := 0.0; v <= top+1e-9; v += step {
		out = append(out, v)
	}
	return out
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
