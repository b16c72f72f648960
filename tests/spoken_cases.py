"""Written text -> the spoken form a native speaker reads aloud, written by hand.

Each case is (written, [accepted spoken forms]): where people commonly read a text in more than one way
(1.75米 as 一米七五 or 一点七五米, 2008 as "two thousand eight" or "twenty oh eight") every common reading is
listed and any one is accepted. `same_speech` compares what a voice would say: case, hyphens between
number words and commas between words are not spoken in English (tests/test_spoken.py).
"""

from __future__ import annotations

# fmt: off
ZH_CASES = [
    # the sentence
    ("我有3个苹果，价格是12.5元，增长了45%。", ["我有三个苹果，价格是十二点五元，增长了百分之四十五。"]),
    # cardinals
    ("共有1234人", ["共有一千二百三十四人", "共有一千两百三十四人"]),
    ("人口10000", ["人口一万"]),
    ("一共100本", ["一共一百本"]),
    ("第101号", ["第一百零一号"]),
    ("房间110", ["房间一百一十", "房间幺幺零", "房间一一零"]),
    ("一共1005个", ["一共一千零五个"]),
    ("大约15个", ["大约十五个"]),
    ("至少1000000元", ["至少一百万元"]),
    ("海拔8848米", ["海拔八千八百四十八米"]),
    ("得了0分", ["得了零分"]),
    ("1,000人参加", ["一千人参加"]),
    ("约有3万人", ["约有三万人"]),
    ("投资20亿", ["投资二十亿"]),
    ("2个人", ["两个人"]),
    ("买了2本书", ["买了两本书"]),
    # decimals
    ("概率是0.5", ["概率是零点五"]),
    ("圆周率约3.14159", ["圆周率约三点一四一五九"]),
    ("误差0.01", ["误差零点零一"]),
    ("版本3.0", ["版本三点零"]),
    ("用了2.5小时", ["用了二点五小时", "用了两点五小时"]),
    ("营收3.5亿元", ["营收三点五亿元"]),
    # fractions
    ("1/2的人", ["二分之一的人"]),
    ("3/4的学生", ["四分之三的学生"]),
    ("只占1/3", ["只占三分之一"]),
    ("5/8英寸", ["八分之五英寸"]),
    # negatives
    ("温度是-5度", ["温度是负五度", "温度是零下五度"]),
    ("结果为-10", ["结果为负十"]),
    ("气温-3.5℃", ["气温负三点五摄氏度", "气温零下三点五摄氏度", "气温负三点五度", "气温零下三点五度"]),
    # percentages
    ("降低了50%", ["降低了百分之五十"]),
    ("利率12.5%", ["利率百分之十二点五"]),
    ("完成了100%", ["完成了百分之一百", "完成了百分之百"]),
    ("占70%的份额", ["占百分之七十的份额"]),
    # currencies
    ("花了¥100", ["花了一百元", "花了人民币一百元"]),
    ("一共100元", ["一共一百元"]),
    ("只要50美元", ["只要五十美元"]),
    ("价格$20", ["价格二十美元"]),
    ("门票€30", ["门票三十欧元"]),
    ("运费£15", ["运费十五英镑"]),
    ("共计¥1,234.56", ["共计一千二百三十四点五六元", "共计一千两百三十四点五六元", "共计一千二百三十四元五角六分",
                     "共计人民币一千二百三十四点五六元", "共计一千二百三十四块五毛六"]),
    # dates and years
    ("2026年12月2日开会", ["二零二六年十二月二日开会", "二零二六年十二月二号开会"]),
    ("日期是2026-12-02", ["日期是二零二六年十二月二日", "日期是二零二六年十二月二号"]),
    ("生于1998年", ["生于一九九八年"]),
    ("12月25日是圣诞节", ["十二月二十五日是圣诞节", "十二月二十五号是圣诞节"]),
    ("今天是10月1日", ["今天是十月一日", "今天是十月一号"]),
    ("2020-2025年", ["二零二零到二零二五年", "二零二零至二零二五年", "二零二零年到二零二五年",
                     "二零二零年至二零二五年"]),
    ("2024年是闰年", ["二零二四年是闰年"]),
    # times
    ("下午3:30见", ["下午三点三十分见", "下午三点半见", "下午三点三十见"]),
    ("14:05出发", ["十四点零五分出发", "十四点五分出发", "下午两点零五分出发", "下午两点五分出发"]),
    ("北京时间18:00", ["北京时间十八点", "北京时间十八点整"]),
    ("上午9点", ["上午九点"]),
    ("时间是12:30:45", ["时间是十二点三十分四十五秒"]),
    # ranges
    ("休息3-5天", ["休息三到五天", "休息三至五天"]),
    ("需要10~20人", ["需要十到二十人", "需要十至二十人"]),
    # phone numbers: digit by digit, 1 as 一 or 幺, "+" as 加, a pause (or none) between the groups as written
    ("电话13812345678", ["电话一三八一二三四五六七八", "电话幺三八幺二三四五六七八"]),
    ("请拨打110", ["请拨打一一零", "请拨打幺幺零"]),
    ("请拨打+86 138 1234 5678。", ["请拨打加八六，幺三八，幺二三四，五六七八。", "请拨打加八六幺三八幺二三四五六七八。",
                               "请拨打加八六，一三八，一二三四，五六七八。"]),
    ("请拨打+8613812345678", ["请拨打加八六幺三八幺二三四五六七八", "请拨打加八六一三八一二三四五六七八"]),
    ("我的手机号是138-1234-5678", ["我的手机号是幺三八，幺二三四，五六七八", "我的手机号是幺三八幺二三四五六七八",
                              "我的手机号是一三八，一二三四，五六七八", "我的手机号是一三八一二三四五六七八"]),
    ("请拨打010-12345678。", ["请拨打零幺零，幺二三四五六七八。", "请拨打零一零，一二三四五六七八。",
                          "请拨打零一零一二三四五六七八。", "请拨打零幺零幺二三四五六七八。"]),
    ("客服热线400-820-8820", ["客服热线四零零，八二零，八八二零", "客服热线四零零八二零八八二零"]),
    ("电话87654321", ["电话八七六五四三二幺", "电话八七六五四三二一"]),
    ("联系方式：+86 10 8765 4321", ["联系方式：加八六，幺零，八七六五，四三二幺",
                                  "联系方式：加八六，一零，八七六五，四三二一"]),
    ("座机号码是020-8765-4321", ["座机号码是零二零，八七六五，四三二幺", "座机号码是零二零，八七六五，四三二一",
                             "座机号码是零二零八七六五四三二幺"]),
    ("传真：(010) 8765 4321", ["传真：零幺零，八七六五，四三二幺", "传真：零一零，八七六五，四三二一"]),
    # ... and what is not a phone number, even after a phone word
    ("号码有效期至2026-12-02", ["号码有效期至二零二六年十二月二日", "号码有效期至二零二六年十二月二号"]),
    ("手机销量12000000部", ["手机销量一千二百万部", "手机销量一千两百万部"]),
    ("电话费12.5元", ["电话费十二点五元"]),
    ("请在10:30前致电", ["请在十点三十分前致电", "请在十点半前致电"]),
    # ordinals
    ("第1名", ["第一名"]),
    ("第22届", ["第二十二届"]),
    ("第3季度", ["第三季度"]),
    ("第2天", ["第二天"]),
    # units
    ("跑了5km", ["跑了五千米", "跑了五公里"]),
    ("重3kg", ["重三千克", "重三公斤"]),
    ("体温37℃", ["体温三十七摄氏度", "体温三十七度"]),
    ("内存16GB", ["内存十六GB", "内存十六吉字节", "内存十六G"]),
    ("身高1.75米", ["身高一点七五米", "身高一米七五"]),
    ("重1.5kg", ["重一点五千克", "重一点五公斤"]),
    ("走了100米", ["走了一百米"]),
    ("打9折", ["打九折"]),
    # mixed Chinese / English, and control tokens
    ("我用ChatTTS打了100分", ["我用ChatTTS打了一百分"]),
    ("iPhone 15发布了", ["iPhone 十五发布了", "iPhone十五发布了"]),
    ("你好[uv_break]我有3本书[laugh_0]", ["你好[uv_break]我有三本书[laugh_0]"]),
    ("[oral_2]价格是12元[lbreak]", ["[oral_2]价格是十二元[lbreak]"]),
    ("四川美食确实以辣闻名，但也有不辣的选择。", ["四川美食确实以辣闻名，但也有不辣的选择。"]),
]

EN_CASES = [
    # the sentence
    ("Meet me at 10:30 on 2026-12-02, it costs $12.50.",
     ["Meet me at ten thirty on December second, twenty twenty six, it costs twelve dollars and fifty cents.",
      "Meet me at ten thirty on December second, twenty twenty six, it costs twelve dollars fifty cents.",
      "Meet me at ten thirty on December second, twenty twenty six, it costs twelve fifty.",
      "Meet me at ten thirty on the second of December, twenty twenty six, it costs twelve dollars and fifty cents.",
      "Meet me at ten thirty on the second of December, twenty twenty six, it costs twelve dollars fifty cents.",
      "Meet me at ten thirty on the second of December, twenty twenty six, it costs twelve fifty."]),
    # cardinals
    ("I have 3 apples.", ["I have three apples."]),
    ("There are 1234 people.", ["There are one thousand two hundred thirty four people.",
                                "There are one thousand two hundred and thirty four people.",
                                "There are twelve hundred thirty four people."]),
    ("It sold 1,000,000 copies.", ["It sold one million copies."]),
    ("We need 2,500 chairs.", ["We need two thousand five hundred chairs.", "We need twenty five hundred chairs."]),
    ("About 10000 fans came.", ["About ten thousand fans came."]),
    ("The score was 0.", ["The score was zero.", "The score was nil."]),
    ("Add 7 more.", ["Add seven more."]),
    ("She is 13.", ["She is thirteen."]),
    ("It costs 99 cents.", ["It costs ninety nine cents."]),
    ("Give me 100 reasons.", ["Give me one hundred reasons.", "Give me a hundred reasons."]),
    ("1000 years ago.", ["One thousand years ago.", "A thousand years ago."]),
    ("Read chapter 11.", ["Read chapter eleven."]),
    ("I bought 1 apple.", ["I bought one apple."]),
    ("It has 1.5 million users.", ["It has one point five million users."]),
    ("They raised 2 billion dollars.", ["They raised two billion dollars."]),
    # decimals
    ("The ratio is 0.5.", ["The ratio is zero point five.", "The ratio is point five."]),
    ("Pi is about 3.14.", ["Pi is about three point one four."]),
    ("The error is 0.01.", ["The error is zero point zero one.", "The error is point zero one.",
                             "The error is zero point oh one.", "The error is point oh one."]),
    ("It took 2.5 hours.", ["It took two point five hours.", "It took two and a half hours."]),
    ("Version 3.0 is out.", ["Version three point zero is out.", "Version three point oh is out."]),
    # fractions
    ("Add 1/2 cup of sugar.", ["Add one half cup of sugar.", "Add a half cup of sugar.", "Add half a cup of sugar."]),
    ("About 3/4 of them agreed.", ["About three quarters of them agreed.", "About three fourths of them agreed."]),
    ("Use a 5/8 inch bolt.", ["Use a five eighths inch bolt.", "Use a five eighth inch bolt."]),
    ("Only 1/3 remained.", ["Only one third remained.", "Only a third remained."]),
    # negatives
    ("The result is -7.", ["The result is minus seven.", "The result is negative seven."]),
    ("It fell to -3.5 degrees.", ["It fell to minus three point five degrees.",
                                  "It fell to negative three point five degrees."]),
    # percentages
    ("Sales grew 45%.", ["Sales grew forty five percent."]),
    ("A rate of 12.5% applies.", ["A rate of twelve point five percent applies."]),
    ("I am 100% sure.", ["I am one hundred percent sure.", "I am a hundred percent sure."]),
    # currencies
    ("It costs $5.", ["It costs five dollars."]),
    ("Only $1.99 today.", ["Only one dollar and ninety nine cents today.", "Only one dollar ninety nine cents today.",
                           "Only one ninety nine today.", "Only one dollar ninety nine today."]),
    ("The fee is €20.", ["The fee is twenty euros.", "The fee is twenty euro."]),
    ("He paid £15.", ["He paid fifteen pounds."]),
    ("It was ¥100.", ["It was one hundred yen.", "It was a hundred yen.", "It was one hundred yuan.",
                      "It was a hundred yuan."]),
    ("Rent is $1,000.", ["Rent is one thousand dollars.", "Rent is a thousand dollars."]),
    ("A coffee is £2.50.", ["A coffee is two pounds fifty.", "A coffee is two pounds and fifty pence.",
                            "A coffee is two pounds fifty pence.", "A coffee is two pounds and fifty p."]),
    # dates and years
    ("It happened on March 3, 2021.", ["It happened on March third, twenty twenty one.",
                                       "It happened on the third of March, twenty twenty one.",
                                       "It happened on March third, two thousand twenty one.",
                                       "It happened on March third, two thousand and twenty one."]),
    ("The date is 2026-12-02.", ["The date is December second, twenty twenty six.",
                                 "The date is the second of December, twenty twenty six."]),
    ("Born in 1999.", ["Born in nineteen ninety nine."]),
    ("It closed in 2008.", ["It closed in two thousand eight.", "It closed in twenty oh eight.",
                            "It closed in two thousand and eight."]),
    ("Music of the 1990s.", ["Music of the nineteen nineties."]),
    ("From 2019 to 2020.", ["From twenty nineteen to twenty twenty.",
                            "From two thousand nineteen to two thousand twenty."]),
    ("Happy 4th of July!", ["Happy fourth of July!"]),
    # times
    ("The train leaves at 7:45.", ["The train leaves at seven forty five."]),
    ("Lunch is at 12:00.", ["Lunch is at twelve o'clock.", "Lunch is at twelve.", "Lunch is at twelve hundred."]),
    ("Wake up at 6:05.", ["Wake up at six oh five.", "Wake up at six zero five."]),
    ("Open at 9 am.", ["Open at nine a m.", "Open at nine AM.", "Open at nine a.m."]),
    # ranges
    ("Wait 3-5 days.", ["Wait three to five days."]),
    ("See pages 10-20.", ["See pages ten to twenty.", "See pages ten through twenty."]),
    # phone numbers: digit by digit, 0 as "oh" or "zero", a pause between the groups as written
    ("Call 555-123-4567.", ["Call five five five, one two three, four five six seven."]),
    ("Call (555) 123-4567 now.", ["Call five five five, one two three, four five six seven now."]),
    ("Call 555-0199 now.", ["Call five five five, oh one nine nine now.",
                            "Call five five five, zero one nine nine now."]),
    ("Call +1 555 123 4567 now.", ["Call plus one, five five five, one two three, four five six seven now."]),
    ("Call 1-800-555-0199 today.", ["Call one eight hundred, five five five, oh one nine nine today.",
                                    "Call one eight hundred, five five five, zero one nine nine today.",
                                    "Call one eight zero zero, five five five, zero one nine nine today."]),
    ("Call +44 20 7946 0958 now.", ["Call plus four four, two oh, seven nine four six, oh nine five eight now.",
                                    "Call plus four four, two zero, seven nine four six, zero nine five eight now.",
                                    "Call plus four four, twenty, seven nine four six, oh nine five eight now."]),
    ("Our number is 555 123 4567.", ["Our number is five five five, one two three, four five six seven."]),
    ("Call me at +1 (555) 123-4567.", ["Call me at plus one, five five five, one two three, four five six seven."]),
    ("Dial 555.123.4567 for help.", ["Dial five five five, one two three, four five six seven for help."]),
    ("Tel: 020 7946 0958", ["Tel: oh two oh, seven nine four six, oh nine five eight",
                            "Tel: zero two zero, seven nine four six, zero nine five eight"]),
    ("Call 5550199.", ["Call five five five, oh one nine nine.", "Call five five five, zero one nine nine."]),
    ("+86 138 1234 5678 is my number.",
     ["plus eight six, one three eight, one two three four, five six seven eight is my "
                                         "number."]),
    # ... and what is not a phone number, even after a phone word
    ("It sold 1234567 copies.",
     ["It sold one million two hundred thirty four thousand five hundred sixty seven copies.",
                                 "It sold one million two hundred and thirty four thousand five hundred and sixty "
                                 "seven "
                                 "copies."]),
    ("Call me on 2026-12-02.", ["Call me on December second, twenty twenty six.",
                                "Call me on the second of December, twenty twenty six."]),
    ("Call 3-5 times a day.", ["Call three to five times a day."]),
    ("Call me at 10:30.", ["Call me at ten thirty."]),
    # ordinals
    ("She came 1st.", ["She came first."]),
    ("He was 2nd.", ["He was second."]),
    ("On the 23rd floor.", ["On the twenty third floor."]),
    ("The 101st day.", ["The one hundred first day.", "The hundred and first day.", "The one hundred and first day."]),
    ("The 21st century.", ["The twenty first century."]),
    # units
    ("I ran 5 km.", ["I ran five kilometers.", "I ran five kilometres."]),
    ("He weighs 70 kg.", ["He weighs seventy kilograms.", "He weighs seventy kilogrammes."]),
    ("It is 37 °C.", ["It is thirty seven degrees Celsius.", "It is thirty seven degrees centigrade."]),
    ("It has 16 GB of memory.", ["It has sixteen gigabytes of memory.", "It has sixteen gigs of memory."]),
    ("Swim 100 m.", ["Swim one hundred meters.", "Swim one hundred metres.", "Swim a hundred meters."]),
    ("Add 500 ml of water.", ["Add five hundred milliliters of water.", "Add five hundred millilitres of water."]),
    # control tokens and plain text stay as they are
    ("Hello [uv_break] I have 2 cats [laugh_0].", ["Hello [uv_break] I have two cats [laugh_0]."]),
    ("[oral_2]It is 5 pm[lbreak]", ["[oral_2]It is five p m[lbreak]", "[oral_2]It is five PM[lbreak]",
                                    "[oral_2]It is five p.m.[lbreak]"]),
    ("Hello world, this is a plain sentence.", ["Hello world, this is a plain sentence."]),
]
# fmt: on
