package idemkey

import (
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// dateLayout is the IMF-fixdate of RFC 9110, section 5.6.7: an HTTP date.
const dateLayout = "Mon, 02 Jan 2006 15:04:05 GMT"

// FormatDate returns t as an HTTP date (IMF-fixdate), the form of
// ExpiresHeader and FirstSentHeader on every transport, such as
// "Tue, 01 Dec 2026 20:05:37 GMT". It has whole seconds: t is truncated.
func FormatDate(t time.Time) string {
	unix := t.Unix()
	written := &writtenDates[uint64(unix)%uint64(len(writtenDates))]
	if w := written.Load(); w != nil && w.unix == unix {
		return w.text
	}
	t = t.UTC()
	year, month, day := t.Date()
	if year < 0 || year > 9999 {
		return t.Format(dateLayout) // its own way with years of other than four digits
	}
	// What t.Format(dateLayout) writes, without reading the layout: every
	// answer about a key tells its expiry.
	hour, minute, sec := t.Clock()
	b := make([]byte, 0, len(dateLayout))
	b = append(b, t.Weekday().String()[:3]...)
	b = append(b, ", "...)
	b = appendDigits(b, day, 2)
	b = append(b, ' ')
	b = append(b, month.String()[:3]...)
	b = append(b, ' ')
	b = appendDigits(b, year, 4)
	b = append(b, ' ')
	b = appendDigits(b, hour, 2)
	b = append(b, ':')
	b = appendDigits(b, minute, 2)
	b = append(b, ':')
	b = appendDigits(b, sec, 2)
	b = append(b, " GMT"...)
	text := string(b)
	written.Store(&writtenDate{unix: unix, text: text})
	return text
}

// writtenDates are the dates FormatDate wrote last, one for each second
// modulo their number, which it is most often asked for again: a key's
// expiry is its first call's second plus the retention, the same for the
// first calls of one second and for the retries that follow them within a
// minute.
var writtenDates [64]atomic.Pointer[writtenDate]

type writtenDate struct {
	unix int64 // its time, in whole seconds
	text string
}

// appendDigits appends n, which is at least 0, in width decimal digits.
func appendDigits(b []byte, n, width int) []byte {
	var d [4]byte
	for i := width - 1; i >= 0; i-- {
		d[i] = byte('0' + n%10)
		n /= 10
	}
	return append(b, d[:width]...)
}

// ErrDate is ParseDate's error: the value is an HTTP date in none of its
// three forms.
var ErrDate = errors.New("idemkey: not an HTTP date (such as \"Tue, 01 Dec 2026 20:05:37 GMT\")")

// ParseDate reads an HTTP date in any of the three forms that RFC 9110,
// section 5.6.7, has a recipient accept: the IMF-fixdate FormatDate writes
// ("Sun, 06 Nov 1994 08:49:37 GMT"), and the obsolete RFC 850
// ("Sunday, 06-Nov-94 08:49:37 GMT") and asctime ("Sun Nov  6 08:49:37 1994")
// forms, all in GMT. An RFC 850 date's two-digit year is the one of its
// century nearest now: a date more than 50 years in the future is one of the
// century before. Each form is read as RFC 9110 writes it, to the letter
// (the case of names, the digits of each number, the spaces); only the day
// name is not checked against the date, as net/http does not check it.
func ParseDate(v string) (time.Time, error) {
	for i := range dateForms {
		if t, ok := dateForms[i].parse(v); ok {
			return t, nil
		}
	}
	return time.Time{}, ErrDate
}

// dateForm is one form of an HTTP date: a day name, then what layout reads.
type dateForm struct {
	days    []string // the day names it is written with
	sep     string   // what follows the day name
	layout  string   // the rest, for time.Parse
	century bool     // the layout's year has two digits (RFC 850)
}

var (
	shortDays = []string{"Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"}
	longDays  = []string{"Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"}

	// dateForms are the forms of RFC 9110, section 5.6.7. asctime's day of
	// the month is two digits or a space and one digit: a layout each.
	dateForms = []dateForm{
		{shortDays, ", ", dateLayout[len("Mon, "):], false},
		{longDays, ", ", "02-Jan-06 15:04:05 GMT", true},
		{shortDays, " ", "Jan _2 15:04:05 2006", false},
		{shortDays, " ", "Jan 02 15:04:05 2006", false},
	}
)

// parse reads v in form f, and ok is false unless v is written as f writes
// it: time.Parse alone would take other case, one-digit hours or fractions
// of a second, so what it read must format back to v. A two-digit year is
// placed by the clock, read only then.
func (f *dateForm) parse(v string) (t time.Time, ok bool) {
	day, rest, ok := strings.Cut(v, f.sep)
	if !ok || !slices.Contains(f.days, day) {
		return time.Time{}, false
	}
	t, err := time.Parse(f.layout, rest)
	if err != nil || t.Format(f.layout) != rest {
		return time.Time{}, false
	}
	if f.century {
		return nearestCentury(t, time.Now())
	}
	return t, true
}

// nearestCentury is t, whose year time.Parse read from two digits, in the
// year with those two digits that puts it at most 50 years after now and
// less than 50 years before (RFC 9110, section 5.6.7: a date more than 50
// years in the future is of the most recent past year with those digits).
// ok is false if the day does not exist that year (29 February of a century
// year not divisible by 400).
func nearestCentury(t, now time.Time) (time.Time, bool) {
	now = now.UTC()
	year := now.Year() - now.Year()%100 + t.Year()%100
	in := func(year int) time.Time {
		return time.Date(year, t.Month(), t.Day(), t.Hour(), t.Minute(), t.Second(), 0, time.UTC)
	}
	limit := now.AddDate(50, 0, 0)
	switch {
	case in(year).After(limit):
		year -= 100
	case !in(year + 100).After(limit):
		year += 100
	}
	u := in(year)
	return u, u.Day() == t.Day()
}

// ParseExpires reads the key's expiry from the values of an ExpiresHeader
// or ExpiresMetadata field, as a client gets them: ok is false unless there
// is exactly one, an HTTP date (ParseDate). Over HTTP and Connect, a client
// reads a response's (or a Connect error's Meta()):
//
//	expires, ok := idemkey.ParseExpires(h.Values(idemkey.ExpiresHeader))
//
// over gRPC, interceptor.KeyExpiry, or from a trailer of the caller's own:
//
//	expires, ok := idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata))
func ParseExpires(values []string) (t time.Time, ok bool) {
	if len(values) != 1 {
		return time.Time{}, false
	}
	t, err := ParseDate(values[0])
	return t, err == nil
}
